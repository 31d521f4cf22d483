# Run by trainer_env on the node with the interpreter the venv is made from (argv: venv,
# wheelhouse directory on the node); prints one JSON object. Python 3.6+, standard library only.
import json
import os
import platform
import sys

venv, wheelhouse = sys.argv[1], sys.argv[2]


def read_json(path):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def read_text(path):
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


manifest = read_json(os.path.join(wheelhouse, "manifest.json")) or {}
purelib = os.path.join(venv, "lib", "python%d.%d" % sys.version_info[:2], "site-packages")
libc, libc_version = platform.libc_ver()
print(
    json.dumps(
        {
            "python": "%d.%d" % sys.version_info[:2],
            "glibc": libc_version if libc == "glibc" else "0",
            "machine": platform.machine(),
            "venv": os.path.exists(os.path.join(venv, "bin", "python")),
            "purelib": purelib,
            # The site stack's link (site mode), compared with what the role would write.
            "site_pth": read_text(os.path.join(purelib, "rlm-site.pth")),
            # The manifest is written last by the role: the wheels it lists are complete.
            "wheelhouse_digest": manifest.get("digest"),
            "wheelhouse_wheels": [w["file"] + " " + w["sha256"] for w in manifest.get("wheels", [])],
            "wheelhouse_files": sorted(os.listdir(wheelhouse)) if os.path.isdir(wheelhouse) else [],
            # What the venv was last installed from (written by the role after pip succeeded).
            "installed": (read_json(os.path.join(venv, "rlm-wheelhouse.json")) or {}).get("installed"),
        }
    )
)

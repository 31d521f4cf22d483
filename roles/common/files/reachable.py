# Run by preflight on each node (common's sources.yml): can this node fetch what the roles will
# install? argv[1]: JSON {"apt": bool, "yum": bool, "timeout": s, "sources": [{"what", "url",
# "fix", optional "project", "version", "python"}]}. Prints a JSON list of the sources that
# failed, each with "why". Read-only; Python 3.6+, standard library only.
import glob
import json
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request

config = json.loads(sys.argv[1])
TIMEOUT = float(config.get("timeout", 5))
READ_LIMIT = 16 << 20  # a PEP 503 project page; torch's lists every build of every release


def apt_proxies():
    """apt's own proxy settings (Acquire::http::Proxy), which its downloads use."""
    try:
        dump = subprocess.run(
            ["apt-config", "dump"], stdout=subprocess.PIPE, universal_newlines=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found = dict(re.findall(r'^Acquire::(https?)::Proxy "([^"]+)";', dump, re.MULTILINE))
    return {scheme: url for scheme, url in found.items() if url.upper() != "DIRECT"}


def apt_sources():
    """The index files apt update fetches first (one Release file per source)."""
    out = subprocess.run(
        ["apt-get", "--print-uris", "update"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        universal_newlines=True,
        timeout=60,
    ).stdout
    urls = re.findall(r"^'([^']+/InRelease)'", out, re.MULTILINE)
    fix = (
        "point the node's apt sources at a reachable mirror (an air-gapped site: its local "
        "mirror) or set common_update_cache: false where every package is installed already"
    )
    return [{"what": "apt source", "url": url, "fix": fix, "apt": True} for url in urls]


def yum_sources():
    release = ""
    try:
        with open("/etc/os-release") as handle:
            release = re.search(r'^VERSION_ID="?([0-9]+)', handle.read(), re.MULTILINE).group(1)
    except (OSError, AttributeError):
        pass
    found = []
    for path in sorted(glob.glob("/etc/yum.repos.d/*.repo")):
        with open(path) as handle:
            text = handle.read()
        for section in re.split(r"^\[", text, flags=re.MULTILINE)[1:]:
            if re.search(r"^enabled\s*=\s*0", section, re.MULTILINE):
                continue
            base = re.search(r"^(baseurl|mirrorlist|metalink)\s*=\s*(\S+)", section, re.MULTILINE)
            if not base:
                continue
            url = base.group(2).replace("$releasever", release).replace("$basearch", os.uname()[4])
            if base.group(1) == "baseurl":
                url = url.rstrip("/") + "/repodata/repomd.xml"
            found.append(
                {
                    "what": "yum repository " + section.split("]")[0],
                    "url": url,
                    "fix": "point " + path + " at a reachable mirror (an air-gapped site: its local mirror)",
                }
            )
    return found


def fetch(url, proxies):
    """(ok, why, body): GETs the first byte, or the whole page when a project is looked for."""
    if url.startswith("file:"):
        path = re.sub(r"^file:(//)?", "", url)
        # A flat or signed-by-file repository may have only Release, or no signature at all.
        target = os.path.dirname(path) if path.endswith("InRelease") else path
        return (os.path.exists(target), "no such file or directory", None)
    handlers = [urllib.request.ProxyHandler(proxies)] if proxies else []
    opener = urllib.request.build_opener(*handlers)
    request = urllib.request.Request(url, headers={"User-Agent": "rlm-ops-preflight"})
    try:
        with opener.open(request, timeout=TIMEOUT) as response:
            return True, "", response.read(READ_LIMIT)
    except urllib.error.HTTPError as error:
        return False, "HTTP %d %s" % (error.code, error.reason), None
    except urllib.error.URLError as error:
        reason = error.reason
        return False, getattr(reason, "strerror", None) or str(reason), None
    except OSError as error:  # timeouts, resets
        return False, error.strerror or type(error).__name__, None


def check(source, proxies, failed):
    ok, why, body = fetch(source["url"], proxies if source.get("apt") else None)
    if not ok and source.get("apt") and source["url"].endswith("/InRelease"):
        ok, why, body = fetch(source["url"][: -len("InRelease")] + "Release", proxies)
    if ok and source.get("project") and body is not None:
        # A PEP 503 page: the files of the project; the version for this Python must be there.
        tag = "cp" + source["python"].replace(".", "") if source.get("python") else ""
        # Local labels are %2B-quoted in the links: torch-2.13.0%2Bcpu-cp313-cp313-...
        pattern = r"%s-%s((\+|%%2B)[^-]*)?-%s" % (source["project"], re.escape(source["version"]), tag)
        if not re.search(pattern, body.decode("utf-8", "replace")):
            wheel = " ".join(w for w in (source["project"], source["version"], tag) if w)
            ok, why = False, "it has no %s wheel" % wheel
    if not ok:
        failed.append(dict(source, why=why))


sources = list(config["sources"])
failed = []
try:
    if config.get("apt"):
        sources += apt_sources()
    if config.get("yum"):
        sources += yum_sources()
except (OSError, subprocess.SubprocessError) as error:
    what = "apt" if config.get("apt") else "yum"
    failed.append({"what": what + " sources", "url": "-", "why": str(error), "fix": "check the package manager runs"})
proxies = apt_proxies() if config.get("apt") else {}
threads = [threading.Thread(target=check, args=(s, proxies, failed)) for s in sources]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(sorted(failed, key=lambda f: f["url"])))

"""The trainer as an OCI image, built offline from the rig's Debian root and a wheelhouse.

No registry is pulled from: the base is the very root the rig's systemd nodes boot (image.py:
mmdebstrap bookworm, Debian's Python), imported into podman's storage with `podman import`; the
trainer is installed into it from a wheelhouse (the bundle's wheel and every wheel it needs, as
a site's rlm_wheelhouse holds them) by pip on this host, into the image's root mounted with
`podman mount`, and committed. Three layers, each tagged by the hash of its own inputs:

    localhost/rlm-debian:<rig image key>         the node root
    localhost/rlm-trainer-deps:<key>             + every wheel but the bundle's (torch, ...)
    localhost/rlm-trainer:<key>                  + the bundle (label org.rlm-ops.inputs=<key>)

A wheel counts by its name and its RECORD (the hash of every file it installs), not by its
bytes: a bundle wheel rebuilt from unchanged sources differs in its zip timestamps only and
reuses the image. So the suite builds an image when the root or a wheel's content changes, and
otherwise finds it by its tag (`podman image exists`). Python packages go to
/usr/local/lib/python3.<minor>/dist-packages, on the image python3's path: `python3 -m trainer`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import resource
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.rig.errors import RigError
from tests.rig.image import IMAGE_ROOT, ensure_image, image_path
from tests.rig.rig import Rig

FORMAT = 1
BASE = "localhost/rlm-debian"
DEPS = "localhost/rlm-trainer-deps"
TRAINER = "localhost/rlm-trainer"
INPUTS_LABEL = "org.rlm-ops.inputs"
BUNDLE = "rlm_ops-"  # the bundle's wheel file name starts with this
SUITE = "bookworm"
TIMEOUT_S = 1800
# podman 4.3 here starts the container's runtime with RLIMIT_NPROC 32768 (measured: a container
# asking more fails "error setting rlimit type 6"); the nodes run as root, for which the kernel
# does not enforce NPROC anyway.
NPROC_MAX = 32768


@dataclass(frozen=True)
class TrainerImage:
    ref: str  # localhost/rlm-trainer:<key>
    key: str
    built: tuple[str, ...]  # the layers this call built (empty: all cached)
    seconds: float


def wheel_key(wheel: Path) -> str:
    """A wheel's name and the content of what it installs (its RECORD): stable across rebuilds."""
    with zipfile.ZipFile(wheel) as archive:
        record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        lines = sorted(
            line
            for line in archive.read(record).decode().splitlines()
            if line and not line.startswith(record)
        )
    return hashlib.sha256("\n".join([wheel.name, *lines]).encode()).hexdigest()


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps([FORMAT, *parts]).encode()).hexdigest()[:16]


def split_wheelhouse(wheelhouse: Path) -> tuple[list[Path], Path]:
    """(every other wheel, the bundle's wheel) of a wheelhouse."""
    wheels = sorted(wheelhouse.glob("*.whl"))
    bundles = [w for w in wheels if w.name.startswith(BUNDLE)]
    if len(bundles) != 1:
        raise RigError(
            f"{wheelhouse} holds {len(bundles)} {BUNDLE}*.whl; it needs exactly one bundle wheel"
        )
    return [w for w in wheels if w is not bundles[0]], bundles[0]


def image_keys(wheelhouse: Path) -> tuple[str, str, str]:
    """(base, deps, trainer) tags: each layer's key covers its inputs and the layer below."""
    base = image_path(SUITE).name.split("-", 1)[1]
    deps, bundle = split_wheelhouse(wheelhouse)
    deps_key = _digest(base, [wheel_key(w) for w in deps])
    return base, deps_key, _digest(deps_key, wheel_key(bundle))


def podman(*args: str, stdin=None, timeout: float = TIMEOUT_S) -> str:
    result = subprocess.run(
        ["podman", *args], capture_output=True, text=stdin is None, stdin=stdin, timeout=timeout
    )
    if result.returncode != 0:
        err = result.stderr if isinstance(result.stderr, str) else result.stderr.decode()
        why = (err.strip().splitlines() or ["no output"])[-1]
        raise RigError(f"podman {args[0]} failed: {why}")
    return result.stdout if isinstance(result.stdout, str) else result.stdout.decode()


def exists(ref: str) -> bool:
    return subprocess.run(["podman", "image", "exists", ref], capture_output=True).returncode == 0


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    IMAGE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(IMAGE_ROOT / ".container.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _python_minor(root: Path) -> str:
    found = sorted(p.name for p in (root / "usr/lib").glob("python3.*") if p.name[8:].isdigit())
    if not found:
        raise RigError(f"{root} has no /usr/lib/python3.N")
    return found[-1]


def _layer(below: str, ref: str, wheels: list[Path], labels: dict[str, str]) -> None:
    """`ref` = `below` + the wheels installed into its Python's dist-packages."""
    container = podman("create", below, "python3").strip()
    try:
        root = Path(podman("mount", container).strip())
        target = root / "usr/local/lib" / _python_minor(root) / "dist-packages"
        pip = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
             "--no-compile", "--disable-pip-version-check", "--target", str(target),
             *map(str, wheels)],
            capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        podman("unmount", container)
        if pip.returncode != 0:
            why = (pip.stderr.strip().splitlines() or ["no output"])[-1]
            raise RigError(f"installing the wheels into {ref} failed: {why}")
        changes = [arg for k, v in labels.items() for arg in ("--change", f"LABEL {k}={v}")]
        podman("commit", "--quiet", *changes, container, ref)
    finally:
        subprocess.run(["podman", "rm", "--force", container], capture_output=True)


def run_argv(*options: str) -> list[str]:
    """`podman run` as this machine kind allows it: runc where cgroup v1 and v2 are mounted side
    by side (crun 1.8 refuses that "hybrid mode"), and limits no higher than this process's:
    without CAP_SYS_RESOURCE (as on this machine kind) podman's own defaults (nofile 1048576)
    cannot be set. No network: nothing in the image reaches out."""
    runtime = ["--runtime", "runc"] if Path("/sys/fs/cgroup/unified").is_dir() else []
    return ["podman", *runtime, "run", "--rm", "--network=none", *limit_options(), *options]


def limit_options() -> list[str]:
    """`podman run`'s limits as this machine kind allows them (see run_argv)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1] % 2**63, NPROC_MAX)
    return [f"--ulimit=nofile={soft}:{hard}", f"--ulimit=nproc={nproc}:{nproc}"]


# What a rig host lacks for podman that a real node has, set up by `prepare_podman_host`:
# - cgroups: a rig host mounts a fresh sysfs, so its /sys/fs/cgroup is empty; the machine's
#   hierarchies are mounted there as on the machine (v1 controllers, systemd's named one, v2).
# - storage: a rig host's root is an overlay of the machine's, and podman refuses overlay storage
#   on overlayfs ("a mount_program is required"); its own storage goes to the shared directory
#   (ext4), and the machine's storage, where the suite built the image, is an additional,
#   read-only image store: nothing is copied.
# - runc where cgroup v1 and v2 are mounted side by side (see run_argv); events to a file (no
#   journald in a rig host).
_PODMAN_HOST_SCRIPT = r"""
set -eu
if ! mountpoint -q /sys/fs/cgroup; then
    mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup
    for c in $CONTROLLERS; do
        mkdir -p "/sys/fs/cgroup/$c" && mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c"
    done
    if [ -n "$NAMED" ]; then
        mkdir -p /sys/fs/cgroup/systemd
        mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd
    fi
    if [ -n "$UNIFIED" ]; then
        mkdir -p "/sys/fs/cgroup/$UNIFIED" && mount -t cgroup2 cgroup2 "/sys/fs/cgroup/$UNIFIED"
    fi
fi
mkdir -p /etc/containers "$GRAPHROOT"
printf '[storage]\ndriver = "overlay"\ngraphroot = "%s"\nrunroot = "/run/containers/storage"\n[storage.options]\nadditionalimagestores = ["/var/lib/containers/storage"]\n' "$GRAPHROOT" > /etc/containers/storage.conf
printf '[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n%s\n' "$RUNTIME" > /etc/containers/containers.conf
"""


def prepare_podman_host(rig: Rig, host: str) -> None:
    """Let `podman run` of the images built on this machine work in a rig host (see above)."""
    controllers, named, unified = [], False, ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, where, kind, options = line.split()[:4]
        if not where.startswith("/sys/fs/cgroup/"):
            continue
        name = where.removeprefix("/sys/fs/cgroup/")
        if kind == "cgroup2":
            unified = name
        elif "name=systemd" in options.split(","):
            named = True
        elif kind == "cgroup":
            controllers.append(name)
    env = {
        "CONTROLLERS": " ".join(controllers),
        "NAMED": "1" if named else "",
        "UNIFIED": unified,
        "GRAPHROOT": f"{rig.shared_dir}/containers/{host}",
        "RUNTIME": 'runtime = "runc"' if unified else "",
    }
    exports = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
    rig.exec(host, f"{exports} sh -c {shlex.quote(_PODMAN_HOST_SCRIPT)}")


def ensure_trainer_image(wheelhouse: Path) -> TrainerImage:
    """The trainer image of `wheelhouse` on the rig's root, built first where missing."""
    if shutil.which("podman") is None:
        raise RigError("the trainer image needs podman (apt-get install podman)")
    started = time.monotonic()
    base_key, deps_key, key = image_keys(wheelhouse)
    refs = (f"{BASE}:{base_key}", f"{DEPS}:{deps_key}", f"{TRAINER}:{key}")
    built: list[str] = []
    if not exists(refs[2]):
        with _locked():
            if not exists(refs[0]):
                root = ensure_image(SUITE).root
                tar = subprocess.Popen(
                    ["tar", "--numeric-owner", "-C", str(root), "-c", "."], stdout=subprocess.PIPE
                )
                podman("import", "--change", 'CMD ["python3"]', "-", refs[0], stdin=tar.stdout)
                if tar.wait() != 0:
                    raise RigError(f"tar of {root} failed")
                built.append(refs[0])
            deps, bundle = split_wheelhouse(wheelhouse)
            if not exists(refs[1]):
                _layer(refs[0], refs[1], deps, {})
                built.append(refs[1])
            if not exists(refs[2]):
                _layer(refs[1], refs[2], [bundle], {INPUTS_LABEL: key})
                built.append(refs[2])
    return TrainerImage(refs[2], key, tuple(built), time.monotonic() - started)

"""Debian roots for systemd nodes: built once with mmdebstrap, cached by (suite, package lists).

An image is two directories under /var/tmp/rlm-rig-images/<suite>-<hash>/:

- `root/`: a minbase Debian with systemd as init, sshd, Python and what every installed Debian
  has (netbase, iproute2): a bare node, the lower dir of every node's overlay. Its apt sources are
  replaced by one local repository, and its SSH host keys removed (each node gets its own).
- `repo/`: that local apt repository (flat, `apt-ftparchive`), holding the packages the roles
  install and their dependencies, downloaded while building: nodes have no route to any registry,
  like an air-gapped site with a local mirror. Bind-mounted read-only into nodes at REPO_MOUNT.

Images are shared by every rig id (they are read-only lower dirs); a lock serialises builders, and
a build goes to a temporary directory renamed into place, so a killed build leaves no half image.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.rig.errors import RigError

IMAGE_ROOT = Path("/var/tmp/rlm-rig-images")
IMAGE_FORMAT = 2  # 2: dpkg without fsync
REPO_MOUNT = "/srv/rlm-rig-repo"
SUITES = ("bookworm", "trixie")  # Debian 12 and 13
BUILD_TIMEOUT_S = 1800

# A bare node: what a minimal cloud image has before any configuration management. python3-apt
# comes with unattended-upgrades on Debian and Ubuntu cloud images; Ansible's apt module cannot
# plan (check mode) without it.
BASE_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "netbase",
    "iproute2",
    "procps",
    "python3-apt",
)
# What the roles install on Debian (common's base list, firewall, exporters, Prometheus,
# Alertmanager, Slurm) plus what Ansible's own modules need on a bare node (apt, pip).
REPO_PACKAGES = (
    "pciutils",
    "chrony",
    "numactl",
    "rdma-core",
    "ibverbs-utils",
    "python3-venv",
    "git",
    "build-essential",
    "curl",
    "ca-certificates",
    "gnupg",
    "nftables",
    "prometheus-node-exporter",
    "prometheus",
    "prometheus-alertmanager",
    "python3-packaging",
    # The slurm role (slurmctld, slurmd, slurmdbd + MariaDB for accounting, PMIx for srun).
    "slurm-wlm",
    "slurmdbd",
    "munge",
    "mariadb-server",
    "libpmix2",
)
# Alternatives to the list above, fetched by themselves (they conflict with one of its packages).
REPO_ALTERNATIVES = ("systemd-timesyncd",)


@dataclass(frozen=True)
class Image:
    suite: str
    path: Path

    @property
    def root(self) -> Path:
        return self.path / "root"

    @property
    def repo(self) -> Path:
        return self.path / "repo"


def image_key(suite: str, *package_lists: tuple[str, ...]) -> str:
    blob = json.dumps([IMAGE_FORMAT, suite, *(sorted(p) for p in package_lists)]).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def image_path(suite: str) -> Path:
    key = image_key(suite, BASE_PACKAGES, REPO_PACKAGES, REPO_ALTERNATIVES)
    return IMAGE_ROOT / f"{suite}-{key}"


def check_suite(suite: str) -> str:
    if suite not in SUITES:
        raise RigError(f"unknown node release {suite!r}; use one of {', '.join(SUITES)}")
    return suite


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_image(suite: str) -> Image:
    """The cached image of `suite`, built first if missing (~1-2 min and ~1 GB download)."""
    path = image_path(check_suite(suite))
    if (path / "ready").exists():
        return Image(suite, path)
    if shutil.which("mmdebstrap") is None:
        raise RigError("systemd nodes need mmdebstrap (apt-get install mmdebstrap)")
    with _locked(IMAGE_ROOT / f".{suite}.lock"):
        if not (path / "ready").exists():
            _build(suite, path)
    return Image(suite, path)


# Run by mmdebstrap inside its build, `$1` being the new root: fetch (not install) the packages
# the roles install, with their dependencies relative to this base, then export them.
_DOWNLOAD_HOOK = 'chroot "$1" apt-get install --download-only --yes --no-install-recommends '

# Then make the root a bare node of the rig: no registry, per-node host keys and machine id.
# dpkg skips its fsyncs (force-unsafe-io, as container images do): the nodes are thrown away
# after the test, and the roles' apt tasks then install packages in two thirds of the time
# (build-essential and the base list on an idle machine: 9.7 s against 14.4 s).
_FINISH_HOOK = r"""
echo force-unsafe-io > "$1"/etc/dpkg/dpkg.cfg.d/rlm-rig-unsafe-io
rm -f "$1"/etc/apt/sources.list "$1"/etc/apt/sources.list.d/*
echo 'deb [trusted=yes] file:{mount} ./' > "$1"/etc/apt/sources.list.d/rlm-rig-repo.list
rm -f "$1"/etc/ssh/ssh_host_*
: > "$1"/etc/machine-id
mkdir -p "$1"{mount}
"""


def _build(suite: str, path: Path) -> None:
    staging = path.with_name(f".{path.name}.building")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "repo").mkdir(parents=True)
    argv = [
        "mmdebstrap",
        "--quiet",
        "--variant=minbase",
        f"--include={','.join(BASE_PACKAGES)}",
        "--customize-hook",
        _DOWNLOAD_HOOK + " ".join(REPO_PACKAGES),
        *(arg for alt in REPO_ALTERNATIVES for arg in ("--customize-hook", _DOWNLOAD_HOOK + alt)),
        "--customize-hook",
        f"sync-out /var/cache/apt/archives {staging / 'repo'}",
        "--customize-hook",
        _FINISH_HOOK.format(mount=REPO_MOUNT),
        suite,
        str(staging / "root"),
    ]
    started = time.monotonic()
    result = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        errors = [line for line in result.stderr.splitlines() if line.startswith("E: ")]
        detail = (errors or result.stderr.strip().splitlines() or ["no output"])[0]
        raise RigError(f"building the {suite} node image failed: {detail}")
    repo = staging / "repo"
    for leftover in ("partial", "lock"):
        path_ = repo / leftover
        if path_.is_dir():
            shutil.rmtree(path_)
        else:
            path_.unlink(missing_ok=True)
    index_flat_repo(repo)
    (staging / "ready").write_text(
        json.dumps({"suite": suite, "built_s": round(time.monotonic() - started, 1)}) + "\n"
    )
    staging.rename(path)


def index_flat_repo(repo: Path) -> None:
    """Packages and Release for the .debs in `repo`, a flat apt repository (`deb file:repo ./`)."""
    packages = subprocess.run(
        ["apt-ftparchive", "packages", "."], cwd=repo, capture_output=True, check=True
    ).stdout
    (repo / "Packages").write_bytes(packages)
    release = subprocess.run(
        ["apt-ftparchive", "release", "."], cwd=repo, capture_output=True, check=True
    ).stdout
    (repo / "Release").write_bytes(release)

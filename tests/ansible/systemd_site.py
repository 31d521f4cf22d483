"""site.yml on bare systemd rig nodes: the inventory a site would write, and what nodes need offline.

Shared by tests/ansible/test_site_systemd.py and bench/provisioning.py. Nodes are the rig's systemd
nodes (tests/rig/booted.py): Debian images with nothing but systemd, sshd and Python, whose only
package source is the rig's local apt repository. Per release, node 1 of the release is the mgmt
host and the others are compute nodes, as in inventory/example (vendor none, no Lustre).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import platform
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlmctl import wheelhouse
from tests.ansible.playbook_run import REPO
from tests.ansible.rig_site import BUNDLE_VERSION, VENV, build_site_stack, build_wheelhouse
from tests.rig import Rig

__all__ = [
    "BUNDLE_VERSION",
    "SLICE_LIMITS",
    "VENV",
    "build_offline_stacks",
    "connection_vars",
    "full_wheelhouse",
    "site_inventory",
]

# The trainer's and the users' slice limits, set as a site would (not the defaults, so that the
# test sees the inventory's values reach systemd); *_bytes is how systemctl show reports them.
SLICE_LIMITS: dict[str, Any] = {
    "rlm_trainer_memory_max": "3G",
    "rlm_trainer_memory_max_bytes": 3 * 1024**3,
    "rlm_trainer_cpu_weight": 900,
    "rlm_trainer_tasks_max": "5000",
    "rlm_user_memory_max": "1G",
    "rlm_user_memory_max_bytes": 1024**3,
    "rlm_user_cpu_weight": 50,
    "rlm_user_tasks_max": "700",
}

# The site stacks: this checkout's venv (CPython 3.11, torch) for bookworm; for trixie's 3.13 the
# exporter's own dependencies only (its torch comes from a full wheelhouse, on one node).
STACK_313 = ("prometheus-client", "psutil", "pyyaml")
PIP_313 = ["--python-version", "3.13", "--only-binary=:all:"]


def build_offline_stacks(rig: Rig, work: Path) -> tuple[Path, dict[str, Path]]:
    """The bundle's wheelhouse and, per release, the site software stack (on the shared dir)."""
    wheelhouse = build_wheelhouse(work / "wheelhouse")
    stacks = {"bookworm": build_site_stack(rig.shared_dir)}
    if "trixie" in rig.releases:
        target = rig.shared_dir / "site-stack-py313"
        if not target.exists():
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "-t",
                    str(target),
                    *PIP_313,
                    *STACK_313,
                ],
                check=True,
                capture_output=True,
                text=True,
            )
        stacks["trixie"] = target
    return wheelhouse, stacks


# Full wheelhouses (torch, the bundle with [train], every dependency) as `rlmctl wheelhouse`
# builds them, kept across test sessions: one per Python and content of the bundle.
WHEELHOUSES = Path("/var/tmp/rlm-wheelhouses")
# What pip fetches here for torch 2.13.0: the CPU build (+cpu) lies on this machine's disk for
# CPython 3.11 only; for 3.13 PyPI has only its CUDA 13 build, which imports (and runs on the CPU)
# only with its nvidia-* libraries: 2.7 GB of wheels. download.pytorch.org is unreachable here.
TORCH_INDEX = "https://pypi.org/simple"


def bundle_digest() -> str:
    """What the bundle's wheel is built from, and the builder itself."""
    digest = hashlib.sha256()
    files = [REPO / name for name in wheelhouse.BUNDLE_FILES]
    for package in wheelhouse.BUNDLE_PACKAGES:
        files += sorted(
            p for p in (REPO / package).rglob("*") if p.is_file() and "__pycache__" not in p.parts
        )
    for path in files:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def full_wheelhouse(python: str) -> Path:
    """The full offline wheelhouse for CPython `python` ("3.11": Debian 12, "3.13": Debian 13),
    built by the builder on first use and kept until the bundle changes. It is verified into a
    clean venv of that Python where this machine has one (python3.X on PATH)."""
    out = WHEELHOUSES / f"cp{python.replace('.', '')}-{bundle_digest()}"
    with _locked(WHEELHOUSES / ".lock"):
        if not (out / "manifest.json").exists():
            for old in WHEELHOUSES.glob(f"cp{python.replace('.', '')}-*"):
                shutil.rmtree(old)  # an older bundle's: 0.3-2.7 GB each
            target = wheelhouse.Target(
                python=python,
                vendor="none",
                glibc=wheelhouse.this_glibc(),
                machine=platform.machine(),
                torch_index=TORCH_INDEX,
            )
            # Verified into a clean venv where this interpreter is that Python (3.11); the 3.13 one
            # is verified by the Debian 13 node's offline install (a clean venv of 3.13).
            verify = "{}.{}".format(*sys.version_info[:2]) == python
            wheelhouse.build(target, out, check=verify, say=lambda line: print(line, flush=True))
    return out


def connection_vars(rig: Rig) -> dict[str, dict[str, str]]:
    """How Ansible reaches each node: root over SSH with the rig's key and known hosts."""
    return {
        h.name: {
            "ansible_host": h.ip,
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(rig.ssh_key_path),
            "ansible_ssh_common_args": (
                f"-o UserKnownHostsFile={rig.known_hosts_path} -o StrictHostKeyChecking=yes"
            ),
        }
        for h in rig.hosts
    }


def site_inventory(
    rig: Rig, wheelhouse: Path, stacks: dict[str, Path], offline: dict[str, Path] | None = None
) -> dict[str, Any]:
    """The rig's hosts in the example inventory's shape: mgmt + compute groups per release. A
    release's first node is its mgmt node, the others compute nodes; a release with one node is
    a one-node site, its node in both groups.

    Nodes take the bundle from `wheelhouse` and torch from their release's site stack, except
    the nodes in `offline` (name -> full wheelhouse), which install everything from theirs."""
    public_key = rig.ssh_key_path.with_suffix(".pub").read_text().strip()
    by_release: dict[str, list[str]] = {}
    for host in rig.hosts:
        assert host.release, "site_inventory is for systemd nodes"
        by_release.setdefault(host.release, []).append(host.name)
    connection = connection_vars(rig)
    for name, full in (offline or {}).items():
        connection[name] |= {
            "rlm_wheelhouse": str(full),
            "trainer_env_torch_source": "wheelhouse",
            "trainer_env_verify": True,
        }
    mgmt = [names[0] for names in by_release.values()]
    release_groups = {
        release: {
            "hosts": {name: None for name in names},
            "vars": {
                "trainer_env_site_dirs": [str(stacks[release])],
                # The bookworm stack links into this checkout's venv: where that sits under /tmp
                # (a clone in /tmp), the sandboxed exporter needs it bound back in.
                "rlm_exporter_read_only_paths": [sysconfig.get_paths()["purelib"]],
            }
            | ({} if release == "bookworm" else {"trainer_env_verify": False}),
        }
        for release, names in by_release.items()
    }
    return {
        "all": {
            "hosts": connection,
            "children": {
                "mgmt": {"hosts": {name: None for name in mgmt}},
                "compute": {
                    "hosts": {
                        name: None
                        for names in by_release.values()
                        for name in (names if len(names) == 1 else names[1:])
                    },
                },
                **release_groups,
            },
            "vars": {
                "ansible_python_interpreter": "/usr/bin/python3",
                "rlm_gpu_vendor": "none",
                "rlm_gpus_per_node": 1,
                "rlm_shared_fs": "none",
                # No receiver (test_site_systemd's alerting section sets its own).
                "rlm_alert_allow_no_receiver": True,
                "rlm_shared_dir": str(rig.shared_dir),
                "rlm_venv": VENV,
                "rlm_operator_keys": [public_key],
                "rlm_wheelhouse": str(wheelhouse),
                "trainer_env_torch_source": "site",
                "firewall_ssh_sources": [rig.layout.subnet],
                # The controller (the real host's bridge address) reaches Prometheus.
                "rlm_admin_sources": [f"{rig.layout.bridge_ip}/32"],
                "rlm_exporter_gpu_source": "none",
                # vm.*, kernel.* and net.core.* belong to the real host (read-only in nodes): the
                # file is written and loaded by systemd-sysctl at boot, which applies the
                # per-namespace keys (net.ipv4.conf.*) and is refused the others.
                "common_sysctl_apply": False,
                **{k: v for k, v in SLICE_LIMITS.items() if not k.endswith("_bytes")},
            },
        }
    }

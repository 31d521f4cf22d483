"""site.yml on bare systemd rig nodes: the inventory a site would write, and what nodes need offline.

Shared by tests/ansible/test_site_systemd.py and bench/provisioning.py. Nodes are the rig's systemd
nodes (tests/rig/booted.py): Debian images with nothing but systemd, sshd and Python, whose only
package source is the rig's local apt repository. Per release, node 1 of the release is the mgmt
host and the others are compute nodes, as in inventory/example (vendor none, no Lustre).
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

from tests.ansible.rig_site import BUNDLE_VERSION, VENV, build_site_stack, build_wheelhouse
from tests.rig import Rig

__all__ = [
    "BUNDLE_VERSION",
    "SLICE_LIMITS",
    "VENV",
    "build_offline_stacks",
    "connection_vars",
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

# torch 2.13.0 exists here only for CPython 3.11 (bookworm's); trixie's 3.13 gets a stack of the
# exporter's own dependencies, and no torch.
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


def site_inventory(rig: Rig, wheelhouse: Path, stacks: dict[str, Path]) -> dict[str, Any]:
    """The rig's hosts in the example inventory's shape: mgmt + compute groups per release."""
    public_key = rig.ssh_key_path.with_suffix(".pub").read_text().strip()
    by_release: dict[str, list[str]] = {}
    for host in rig.hosts:
        assert host.release, "site_inventory is for systemd nodes"
        by_release.setdefault(host.release, []).append(host.name)
    connection = connection_vars(rig)
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
                    "hosts": {h.name: None for h in rig.hosts if h.name not in mgmt},
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

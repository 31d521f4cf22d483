"""Apply the site playbook for real to rig hosts: the inventory, wheelhouse and site stack it needs.

Shared by the rig tests and bench/provisioning.py. Rig hosts are Debian bookworm network namespaces
with overlay roots and no systemd: GPU roles skip (vendor none), services run through
rlm_service's pidfile fallback, Lustre is off (the rig's shared directory stands in for it).
"""

from __future__ import annotations

import platform
import shutil
import socket
import sys
import sysconfig
from pathlib import Path
from typing import Any

import yaml

from rlmctl import wheelhouse
from tests.rig import Rig

VENV = "/opt/rlm/venv"
BUNDLE_VERSION = "0.1.0"


def build_wheelhouse(out: Path) -> Path:
    """The bundle alone, with its manifest, as `rlmctl wheelhouse --bundle-only` builds it: what
    nodes with a site stack (torch there) install from."""
    shutil.rmtree(out, ignore_errors=True)
    target = wheelhouse.Target(
        python="{}.{}".format(*sys.version_info[:2]),
        vendor="none",
        glibc=wheelhouse.this_glibc(),
        machine=platform.machine(),
        torch_index="",
    )
    wheelhouse.build(target, out, bundle_only=True, check=False, say=lambda _: None)
    return out


def build_site_stack(shared_dir: Path) -> Path:
    """A software stack holding torch and the bundle's other dependencies, on the shared directory.

    Stands in for a site's prebuilt stack (or a vendor image's site-packages): links to this
    interpreter's packages, minus the bundle itself, which trainer_env installs from the wheelhouse.
    """
    stack = shared_dir / "site-stack"
    stack.mkdir(exist_ok=True)
    site_packages = Path(sysconfig.get_paths()["purelib"])
    for entry in site_packages.iterdir():
        if entry.name.startswith(("rlm_ops", "__editable__", "_rlm_ops")):
            continue
        link = stack / entry.name
        if not link.exists():
            link.symlink_to(entry)
    return stack


def site_inventory(rig: Rig, wheelhouse: Path, stack: Path) -> dict[str, Any]:
    inventory = yaml.safe_load(rig.inventory_path.read_text())
    public_key = rig.ssh_key_path.with_suffix(".pub").read_text().strip()
    inventory["all"]["vars"].update(
        {
            "rlm_venv": VENV,
            "rlm_shared_fs": "none",
            "rlm_alert_allow_no_receiver": True,
            "rlm_operator_keys": [public_key],
            "rlm_wheelhouse": str(wheelhouse),
            "trainer_env_torch_source": "site",
            "trainer_env_site_dirs": [str(stack)],
            # Only what the rig's root (the real host's /) already has: no network from nodes.
            "common_packages": ["procps", "iproute2", "nftables"],
            "common_update_cache": False,
            "common_time_sync": "none",
            # vm.* and kernel.* are not per network namespace: writing them would change the
            # real host. The file is written; loading it is left to a real node's boot.
            "common_sysctl_apply": False,
            "firewall_install_package": False,
            "node_exporter_install_package": False,
            "prometheus_install_package": False,
            "alertmanager_install_package": False,
            "rlm_exporter_run_root": str(rig.shared_dir / "runs"),
            "rlm_exporter_gpu_source": "none",
        }
    )
    return inventory


# Run inside a host: connect to ADDRESS PORT; prints "open" or the error's type name
# (TimeoutError where a firewall drops, ConnectionRefusedError where nothing listens).
CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()\n"
    "    print('open')\n"
    "except OSError as error:\n"
    "    print(type(error).__name__)\n"
)


def connect(rig: Rig, source: str, target: str, port: int) -> str:
    """From inside host `source`, a TCP connection to target:port: 'open' or the error's name."""
    return rig.exec(source, ["/usr/bin/python3", "-c", CONNECT, target, str(port)]).stdout.strip()


def connect_from_real_host(address: str, port: int) -> str:
    """From the controller (the real host), the same probe as `connect`."""
    try:
        socket.create_connection((address, port), timeout=2).close()
        return "open"
    except OSError as error:
        return type(error).__name__

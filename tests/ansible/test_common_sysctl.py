"""common's kernel parameters with `common_sysctl_apply: true` on a systemd rig node: check mode
plans the file, the first run writes it and loads it into the kernel, a rerun changes nothing,
and a value changed by hand since is loaded again although the file is unchanged.

Only per-namespace keys (net.ipv4.conf.*): a node may set those, not vm.* or kernel.* (docs/rig.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.ansible.playbook_run import PlaybookRun, run_playbook, write_inventory
from tests.ansible.systemd_site import connection_vars
from tests.rig import Rig
from tests.test_rig_systemd import systemd_unavailable

pytestmark = pytest.mark.rig
SLOT = 2  # docs/rig.md: this module's slot (make_rig's second private rig, never at once)
KEYS = {"net.ipv4.conf.all.arp_ignore": 1, "net.ipv4.conf.all.arp_announce": 2}
READ = "sysctl -n " + " ".join(KEYS)
PLAY = {
    "name": "common with the kernel parameters loaded",
    "hosts": "all",
    "gather_facts": True,
    "gather_subset": ["min"],
    # The sysctl tasks only: no packages, no time service.
    "vars": {
        "common_packages": [],
        "common_update_cache": False,
        "common_time_sync": "none",
        "common_sysctl": KEYS,
        "common_sysctl_apply": True,
    },
    "roles": ["common"],
}


def test_sysctls_are_loaded_idempotently_and_converge_on_the_kernel(tmp_path: Path) -> None:
    if reason := systemd_unavailable():
        pytest.skip(reason)
    playbook = tmp_path / "common.yml"
    playbook.write_text(yaml.safe_dump([PLAY], sort_keys=False))
    with Rig(1, slot=SLOT, release=["bookworm"]) as rig:
        hosts = {
            name: {**conn, "ansible_python_interpreter": "/usr/bin/python3"}
            for name, conn in connection_vars(rig).items()
        }
        inventory = write_inventory(tmp_path / "hosts.yml", {"all": {"hosts": hosts}})

        def apply(**kwargs: bool) -> PlaybookRun:
            run = run_playbook(playbook, inventory, tmp_path, **kwargs)
            assert run.rc == 0, run.failures("node1") or run.stderr[-2000:]
            return run

        assert rig.exec("node1", READ).stdout.split() == ["0", "0"]  # the kernel's defaults
        check = apply(check=True)
        assert "common : Write the kernel parameters" in check.changed("node1")
        assert rig.exec("node1", READ).stdout.split() == ["0", "0"]
        first = apply()
        assert "common : Load the kernel parameters" in first.changed("node1")
        assert rig.exec("node1", READ).stdout.split() == ["1", "2"]
        written = rig.exec("node1", "cat /etc/sysctl.d/60-rlm.conf").stdout
        assert [line for line in written.splitlines() if not line.startswith("#")] == [
            "net.ipv4.conf.all.arp_ignore=1",
            "net.ipv4.conf.all.arp_announce=2",
        ]
        assert apply().changed("node1") == []
        rig.exec("node1", "sysctl -w net.ipv4.conf.all.arp_ignore=0")
        assert apply().changed("node1") == ["common : Load the kernel parameters"]
        assert rig.exec("node1", READ).stdout.split() == ["1", "2"]
        assert apply().changed("node1") == []

"""Systemd rig nodes (tests/rig/booted.py): Debian 12 and 13 booted with systemd-nspawn in the
rig's network namespaces; sshd as a unit, own cgroups, offline apt, reboot, teardown by PID."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import rig_unavailable
from tests.rig import Rig
from tests.rig.booted import init_process
from tests.rig.image import REPO_MOUNT
from tests.rig.rig import leftovers

pytestmark = pytest.mark.rig
# make_rig hands out slots 1, 2, ...; test_rig_apply keeps 8, the CLI tests 9: these modules
# keep 6 (tests/ansible/test_site_systemd.py), 7 and 5 (teardown).
SLOT = 7
RELEASES = ["bookworm"] * 4 + ["trixie"] * 4
CODENAMES = {"bookworm": "12", "trixie": "13"}


def systemd_unavailable() -> str | None:
    if reason := rig_unavailable():
        return reason
    for tool in ("/usr/bin/systemd-nspawn", "/usr/bin/mmdebstrap"):
        if not os.path.exists(tool):
            return f"systemd nodes need {tool} (apt-get install systemd-container mmdebstrap)"
    return None


@pytest.fixture(scope="module")
def nodes() -> Iterator[Rig]:
    if reason := systemd_unavailable():
        pytest.skip(reason)
    with Rig(len(RELEASES), slot=SLOT, release=RELEASES) as rig:
        yield rig


def test_eight_nodes_boot_systemd_and_serve_ssh_from_a_unit(nodes: Rig) -> None:
    memory = [nodes.memory_bytes(h) or 0 for h in nodes.hosts]
    print(
        f"\n8 systemd nodes up in {nodes.bring_up_s:.1f}s; memory per node "
        f"{min(memory) / 2**20:.0f}-{max(memory) / 2**20:.0f} MiB"
    )
    for host, release in zip(nodes.hosts, RELEASES, strict=True):
        assert nodes.wait_booted(host) == "running", nodes.exec(host, "systemctl --failed").stdout
        out = nodes.ssh(host, "cat /proc/1/comm; hostname; systemctl is-enabled ssh.service")
        assert out.stdout.split() == ["systemd", host.name, "enabled"]
        os_release = nodes.exec(host, "cat /etc/os-release").stdout
        assert f'VERSION_ID="{CODENAMES[release]}"' in os_release
    assert all(m > 0 for m in memory)


def test_each_node_runs_in_its_own_cgroup(nodes: Rig) -> None:
    seen = set()
    for host in nodes.hosts:
        init = init_process(host.netns)
        assert init is not None
        cgroups = Path(f"/proc/{init.pid}/cgroup").read_text()
        own = f"{nodes.layout.prefix}-{host.name}"
        memory_line = next(line for line in cgroups.splitlines() if ":memory:" in line)
        assert memory_line.split(":")[2].startswith(f"/{own}")
        seen.add(memory_line)
    assert len(seen) == len(nodes.hosts)


def test_the_shared_dir_is_bind_mounted_read_write(nodes: Rig) -> None:
    marker = nodes.shared_dir / "from-node1"
    nodes.exec("node1", f"echo hello > {marker}")
    assert marker.read_text() == "hello\n"
    assert nodes.exec("node8", f"cat {marker}").stdout == "hello\n"
    assert nodes.exec("node8", f"test -w {nodes.layout.client_dir}", check=False).returncode == 1


def test_apt_has_only_the_local_repository(nodes: Rig) -> None:
    for host in (nodes.hosts[0], nodes.hosts[-1]):
        nodes.exec(host, "apt-get update -qq", timeout=120)
        policy = nodes.exec(host, "apt-cache policy nftables").stdout
        assert f"file:{REPO_MOUNT} ./ Packages" in policy
        assert "deb.debian.org" not in nodes.exec(host, "apt-get indextargets").stdout
        # A bare node: the roles install these, they are not in the image.
        assert nodes.exec(host, "command -v nft chronyd", check=False).stdout == ""


def test_a_node_may_manage_its_own_network_namespace_but_not_the_clock(nodes: Rig) -> None:
    set_own = "sysctl -w net.ipv4.conf.all.arp_ignore=1"
    assert nodes.exec("node1", set_own).returncode == 0
    assert nodes.exec("node1", "sysctl -w vm.max_map_count=65531", check=False).returncode != 0
    with open("/proc/sys/net/ipv4/conf/all/arp_ignore") as real_host:
        assert real_host.read().strip() == "0"  # the node's namespace only
    capabilities = nodes.exec("node1", "grep CapEff /proc/1/status").stdout.split()[1]
    effective = int(capabilities, 16)
    assert effective & (1 << 12)  # CAP_NET_ADMIN: nftables in the node
    assert not effective & (1 << 25)  # CAP_SYS_TIME: it would set the real host's clock


def test_a_reboot_keeps_the_overlay_and_starts_a_fresh_boot(nodes: Rig) -> None:
    nodes.exec("node2", "echo kept > /etc/rlm-marker; echo gone > /run/rlm-marker")
    before = init_process(nodes.host("node2").netns)
    started = time.monotonic()
    nodes.reboot("node2")
    print(f"\nnode2 rebooted in {time.monotonic() - started:.1f}s")
    assert init_process(nodes.host("node2").netns) != before
    out = nodes.ssh("node2", "cat /etc/rlm-marker; ls /run/rlm-marker 2>&1 || true").stdout
    assert out.splitlines()[0] == "kept"
    assert "No such file" in out
    assert nodes.ssh("node2", "systemctl is-active ssh.service").stdout == "active\n"
    # The other nodes were not touched.
    assert nodes.ssh("node3", "cat /etc/rlm-marker", check=False).returncode != 0


def test_teardown_stops_everything_even_after_the_supervisor_was_killed() -> None:
    if reason := systemd_unavailable():
        pytest.skip(reason)
    rig = Rig(2, slot=5, release="bookworm").up()
    recorded = rig.processes()
    init = init_process(rig.hosts[0].netns)
    assert init is not None
    # A killed supervisor leaves nspawn and the node running: found again by the rig's prefix.
    os.kill(rig.hosts[0].holder.pid, signal.SIGKILL)
    rig.down()
    assert leftovers(rig.layout, [*recorded, init]) == []

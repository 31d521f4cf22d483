"""site.yml on bare systemd nodes, as a new user meets it: 1 mgmt + 3 compute nodes of Debian 12
and of Debian 13 (tests/rig/booted.py), the example inventory's shape (vendor none, no Lustre).

The nodes start with what the first runs on real nodes tripped over: no service user, no chrony, no
nftables, no python3-packaging, and a cloud image's `50-cloud-init.conf` turning password login on.
One rig for the module: check mode, first run, rerun, then checks; the reboot test comes last.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import paramiko
import pytest

from tests.ansible.playbook_run import PlaybookRun, run_playbook, write_inventory
from tests.ansible.systemd_site import build_offline_stacks, site_inventory
from tests.rig import Rig
from tests.test_rig_systemd import systemd_unavailable

# The module's fixture runs site.yml three times on 8 nodes (about 10 min on 2 quiet cores).
pytestmark = [pytest.mark.rig, pytest.mark.timeout(3600)]
SLOT = 6  # see docs/rig.md for the slots of each module
RELEASES = ["bookworm"] * 4 + ["trixie"] * 4
MGMT = ("node1", "node5")
PASSWORD = "Rig-password-1"  # of a throwaway account on throwaway nodes
CLOUD_INIT_SSHD = "/etc/ssh/sshd_config.d/50-cloud-init.conf"
EVERY_NODE_UNITS = ("ssh", "nftables", "prometheus-node-exporter", "rlm-exporter")
MGMT_UNITS = ("prometheus", "prometheus-alertmanager")


@dataclass
class Site:
    rig: Rig
    password_login_before: dict[str, bool]
    check: PlaybookRun
    first: PlaybookRun
    second: PlaybookRun


def password_login(ip: str) -> bool:
    """Whether sshd on `ip` accepts a password login, tried over the wire."""
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # throwaway nodes
    try:
        client.connect(
            ip, username="tester", password=PASSWORD, look_for_keys=False, allow_agent=False
        )
        return True
    except paramiko.AuthenticationException:
        return False
    finally:
        client.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    if reason := systemd_unavailable():
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("site-systemd")
    with Rig(len(RELEASES), slot=SLOT, release=RELEASES) as rig:
        for host in rig.hosts:
            rig.exec(
                host,
                f"printf 'PasswordAuthentication yes\\n' > {CLOUD_INIT_SSHD}; "
                f"useradd -m -s /bin/bash tester && echo 'tester:{PASSWORD}' | chpasswd; "
                "systemctl reload ssh.service",
            )
        before = {h.name: password_login(h.ip) for h in rig.hosts}
        wheelhouse, stacks = build_offline_stacks(rig, work)
        inventory = write_inventory(work / "hosts.yml", site_inventory(rig, wheelhouse, stacks))
        check = run_playbook("site.yml", inventory, work, check=True, timeout=900)
        first = run_playbook("site.yml", inventory, work, timeout=1200)
        second = run_playbook("site.yml", inventory, work, timeout=900) if first.rc == 0 else first
        yield Site(rig, before, check, first, second)


def test_check_mode_on_bare_nodes_completes_and_plans_every_play(site: Site) -> None:
    for host in site.rig.hosts:
        assert site.check.failures(host.name) == [], host.name
        # Planned, not stopped early in the base play: packages, firewall, trainer, exporters.
        for task in ("Install base packages (apt)", "Install nftables", "Run rlm-exporter"):
            assert site.check.ran(host.name, task), (host.name, task)
    for name in MGMT:
        assert site.check.ran(name, "Install Prometheus")
    assert site.check.rc == 0, site.check.stderr[-2000:]


def test_first_run_completes_and_a_rerun_changes_nothing(site: Site) -> None:
    for host in site.rig.hosts:
        assert site.first.failures(host.name) == [], host.name
    assert site.first.rc == 0, site.first.stderr[-2000:]
    for host in site.rig.hosts:
        assert site.second.stats(host.name)["changed"] == 0, site.second.changed(host.name)
    assert site.second.rc == 0


def test_password_login_is_refused_despite_cloud_init(site: Site) -> None:
    assert all(site.password_login_before.values()), site.password_login_before  # reproduced
    for host in site.rig.hosts:
        effective = site.rig.exec(host, "sshd -T | grep -i '^passwordauthentication'").stdout
        assert effective.strip() == "passwordauthentication no", host.name
        assert site.rig.exec(host, f"test -f {CLOUD_INIT_SSHD}").returncode == 0  # left alone
        assert not password_login(host.ip), host.name


def units_of(name: str) -> tuple[str, ...]:
    return EVERY_NODE_UNITS + (MGMT_UNITS if name in MGMT else ())


def assert_units_up(rig: Rig) -> None:
    for host in rig.hosts:
        units = units_of(host.name)
        enabled = rig.exec(host, ["systemctl", "is-enabled", *units], check=False).stdout.split()
        active = rig.exec(host, ["systemctl", "is-active", *units], check=False).stdout.split()
        assert dict(zip(units, enabled, strict=True)) == dict.fromkeys(units, "enabled"), host.name
        assert dict(zip(units, active, strict=True)) == dict.fromkeys(units, "active"), host.name
        # chrony is enabled; it cannot start in a node without CAP_SYS_TIME (ConditionCapability),
        # which nodes must not get: the real host keeps the clock (docs/rig.md).
        chrony = rig.exec(
            host, "systemctl is-enabled chrony; systemctl show -P ConditionResult chrony"
        ).stdout.split()
        assert chrony == ["enabled", "no"], host.name


def assert_firewall_and_sysctls_in_force(rig: Rig) -> None:
    for host in rig.hosts:
        ruleset = rig.exec(host, "nft list table inet rlm").stdout
        assert "policy drop" in ruleset, host.name
        # Per-namespace keys of common_sysctl, loaded by systemd-sysctl at boot.
        sysctls = rig.exec(
            host, "sysctl -n net.ipv4.conf.all.arp_ignore net.ipv4.conf.all.arp_announce"
        )
        assert sysctls.stdout.split() == ["1", "2"], host.name


def test_every_installed_unit_is_enabled_and_active(site: Site) -> None:
    assert site.first.rc == 0
    assert_units_up(site.rig)
    for host in site.rig.hosts:
        assert "policy drop" in site.rig.exec(host, "nft list table inet rlm").stdout


def test_after_a_reboot_units_firewall_and_sysctls_are_back(site: Site) -> None:
    assert site.first.rc == 0
    rig = site.rig
    started = time.monotonic()
    for host in rig.hosts:
        rig.reboot(host, timeout=180)  # waits for a new PID 1 and the end of its start-up
    print(f"\n8 nodes rebooted one by one in {time.monotonic() - started:.1f}s")
    assert_units_up(rig)
    assert_firewall_and_sysctls_in_force(rig)

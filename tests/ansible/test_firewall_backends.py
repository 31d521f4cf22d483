"""The firewall role plans nftables on Debian/Ubuntu and a firewalld zone on EL (check mode,
local connection, the OS faked through rlm_os_family as in test_check_mode.py).

firewalld cannot run here (no systemd, and it would own this shared machine's firewall), so the
planned zone is read by firewalld's own reader (Debian's python3-firewall, the code firewalld
loads its zones with: it validates the XML and every rich rule), and its rules are checked
against the policy the nftables table enforces."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from tests.ansible.playbook_run import PlaybookRun, run_playbook, write_inventory

MGMT, COMPUTE, ADMIN = "10.0.0.1", "10.0.0.2", "192.168.50.0/24"
SYSTEM_PYTHON = "/usr/bin/python3"


def has_firewalld_reader() -> bool:
    probe = [SYSTEM_PYTHON, "-c", "import firewall.core.io.zone"]
    return subprocess.run(probe, capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[PlaybookRun, Path]:
    work = tmp_path_factory.mktemp("firewall")
    playbook = work / "firewall.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Firewall",
                    "hosts": "all",
                    "gather_facts": True,
                    "gather_subset": ["min"],
                    "roles": ["firewall"],
                }
            ]
        )
    )
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    root = work / "root"  # check mode writes nothing; the paths point here all the same
    paths = {
        "firewall_firewalld_zone_dir": str(root / "zones"),
        "firewall_firewalld_conf": str(root / "firewalld.conf"),
        "firewall_ruleset_path": str(root / "nftables.d/rlm.nft"),
        "firewall_main_config": str(root / "nftables.conf"),
    }
    hosts = {
        "el9": {**local, **paths, "rlm_os_family": "RedHat", "rlm_cluster_address": MGMT},
        "deb": {**local, **paths, "rlm_os_family": "Debian", "rlm_cluster_address": COMPUTE},
    }
    inventory = {
        "all": {
            "children": {"mgmt": {"hosts": {"el9": None}}, "compute": {"hosts": hosts}},
            "vars": {"rlm_admin_sources": [ADMIN]},
        }
    }
    run = run_playbook(playbook, write_inventory(work / "hosts.yml", inventory), work, check=True)
    assert run.rc == 0, (run.failures("el9"), run.failures("deb"), run.stderr[-2000:])
    assert not root.exists()
    return run, work


def test_el_plans_firewalld_and_debian_nftables(planned: tuple[PlaybookRun, Path]) -> None:
    run, _ = planned
    el9 = run.changed("el9")
    for task in ("Install firewalld", "Write the rlm zone", "Make the rlm zone the default zone"):
        assert any(name.endswith(task) for name in el9), (task, el9)
    assert not run.ran("el9", "Install nftables") and not run.ran("el9", "Write the rlm ruleset")
    assert run.ran("deb", "Write the rlm ruleset")
    assert not run.ran("deb", "Write the rlm zone") and not run.ran("deb", "Install firewalld")
    default_zone = json.dumps(run.task("el9", "Make the rlm zone the default zone").result)
    assert "DefaultZone=rlm" in default_zone


def zone_xml(run: PlaybookRun) -> str:
    return run.task("el9", "Write the rlm zone").result["diff"][0]["after"]


def rules(zone: ET.Element) -> set[tuple[str, str, str, str]]:
    """(priority, source, port, action) of every rich rule."""
    out = set()
    for rule in zone.iter("rule"):
        source = rule.find("source")
        port = rule.find("port")
        action = next(c.tag for c in rule if c.tag in ("accept", "drop", "reject"))
        out.add(
            (
                rule.get("priority", "0"),
                source.get("address") if source is not None else "",
                port.get("port") if port is not None else "",
                action,
            )
        )
    return out


def test_the_zone_enforces_the_nftables_policy(planned: tuple[PlaybookRun, Path]) -> None:
    run, _ = planned
    zone = ET.fromstring(zone_xml(run).split("\n", 1)[1].split("-->", 1)[1])
    assert zone.get("target") == "DROP"
    assert [p.get("port") for p in zone.findall("port")] == ["22"]  # no ssh sources: anyone
    found = rules(zone)
    for port in ("9100", "9401", "9410", "9400", "5000"):  # exporters: mgmt only
        assert ("-30", MGMT, port, "accept") in found
        assert ("-30", COMPUTE, port, "accept") not in found
        assert ("-10", "", port, "drop") in found
    for port in ("9090", "9093", "3000"):  # admin ports: mgmt and the admin sources
        assert {("-20", MGMT, port, "accept"), ("-20", ADMIN, port, "accept")} <= found
        assert ("-10", "", port, "drop") in found
    # The cluster's accept-all comes after those drops (priority 0 > -10).
    assert {("0", MGMT, "", "accept"), ("0", COMPUTE, "", "accept")} <= found
    protocols = {p.get("value") for p in zone.iter("protocol")}
    assert protocols == {"icmp", "ipv6-icmp"}


@pytest.mark.skipif(not has_firewalld_reader(), reason="needs Debian's python3-firewall")
def test_firewalld_reads_the_zone(planned: tuple[PlaybookRun, Path]) -> None:
    run, work = planned
    zones = work / "zones"
    zones.mkdir()
    (zones / "rlm.xml").write_text(zone_xml(run))
    script = (
        "import sys\n"
        "from firewall.core.io.zone import zone_reader\n"
        "zone = zone_reader('rlm.xml', sys.argv[1])\n"
        "print(len(zone.rules_str), zone.target)\n"
    )
    read = subprocess.run([SYSTEM_PYTHON, "-c", script, str(zones)], capture_output=True, text=True)
    assert read.returncode == 0 and "WARNING" not in read.stdout + read.stderr, read
    # The reader drops (with a warning) a rule it cannot parse: every rule must survive.
    count, target = read.stdout.split()
    written = ET.fromstring(zone_xml(run).split("-->", 1)[1]).findall("rule")
    assert target == "DROP" and int(count) == len(written) > 20

"""site.yml applied for real to a private 2-host rig without systemd (node1 = mgmt, node2 =
compute), applied again with no change, then checked from inside the hosts: users and keys, sshd,
limits, the trainer venv, the detached node_exporter, rlm-exporter, Prometheus and Alertmanager.

Services here run detached (start-stop-daemon, no PID 1 systemd): the path containers take. The
same site.yml on systemd nodes, the firewall's blocked and open ports among them, is
tests/ansible/test_site_systemd.py."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import pytest

from tests.ansible.playbook_run import PlaybookRun, run_playbook, write_inventory
from tests.ansible.rig_site import (
    BUNDLE_VERSION,
    VENV,
    build_site_stack,
    build_wheelhouse,
    site_inventory,
)
from tests.conftest import rig_unavailable
from tests.rig import Rig

# Two site.yml runs on 2 hosts: ~5 min on an idle 2-core machine, over 10 under heavy load.
pytestmark = [pytest.mark.rig, pytest.mark.timeout(1800)]
# make_rig hands out slots 1, 2, ... and the rig CLI tests use 9: this module keeps 8.
SLOT = 8


@pytest.fixture(scope="module")
def applied(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Rig, PlaybookRun, PlaybookRun]]:
    if reason := rig_unavailable():
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("rig-apply")
    with Rig(2, slot=SLOT) as rig:
        wheelhouse = build_wheelhouse(work / "wheelhouse")
        stack = build_site_stack(rig.shared_dir)
        inventory = write_inventory(work / "hosts.yml", site_inventory(rig, wheelhouse, stack))
        first = run_playbook("site.yml", inventory, work)
        second = run_playbook("site.yml", inventory, work) if first.rc == 0 else first
        yield rig, first, second


def test_site_applies_cleanly_then_changes_nothing(
    applied: tuple[Rig, PlaybookRun, PlaybookRun],
) -> None:
    rig, first, second = applied
    hosts = [h.name for h in rig.hosts]
    assert first.rc == 0, {h: first.failures(h) for h in hosts}
    assert all(first.changed(h) for h in hosts)
    assert second.rc == 0, {h: second.failures(h) for h in hosts}
    assert {h: second.changed(h) for h in hosts} == {h: [] for h in hosts}


def test_service_user_keys_and_hardened_sshd(applied: tuple[Rig, PlaybookRun, PlaybookRun]) -> None:
    rig, _, _ = applied
    public_key = rig.ssh_key_path.with_suffix(".pub").read_text().split()[1]
    for host in rig.hosts:
        assert public_key in rig.exec(host, "cat /home/rlm/.ssh/authorized_keys").stdout
        assert rig.exec(host, "/usr/sbin/sshd -t").returncode == 0
        effective = rig.exec(host, "/usr/sbin/sshd -T").stdout
        assert "passwordauthentication no" in effective
        assert "permitrootlogin without-password" in effective
        assert "nofile   1048576" in rig.exec(host, "cat /etc/security/limits.d/90-rlm.conf").stdout
        assert "kernel.numa_balancing=0" in rig.exec(host, "cat /etc/sysctl.d/60-rlm.conf").stdout
    # The reloaded sshd lets the operator in as the service user with the authorised key.
    key = str(rig.ssh_key_path)
    login = rig.exec("node1", ["ssh", "-i", key, "-l", "rlm", "node2", "id", "-un"])
    assert login.stdout.strip() == "rlm"


def test_trainer_venv_has_torch_and_the_bundle(
    applied: tuple[Rig, PlaybookRun, PlaybookRun],
) -> None:
    rig, _, _ = applied
    probe = (
        "import json, importlib.metadata as m, torch, trainer;"
        "d = m.distribution('rlm-ops');"
        "print(json.dumps({'torch': torch.__version__, 'bundle': d.version,"
        " 'where': str(d.locate_file('')), 'devices': torch.cuda.device_count()}))"
    )
    for host in rig.hosts:
        report = json.loads(rig.exec(host, [f"{VENV}/bin/python", "-c", probe], timeout=120).stdout)
        assert report["bundle"] == BUNDLE_VERSION
        assert report["where"].startswith(VENV), report
        assert report["torch"].startswith("2.13.0") and report["devices"] == 0


def test_exporters_prometheus_and_alertmanager_answer(
    applied: tuple[Rig, PlaybookRun, PlaybookRun],
) -> None:
    rig, _, _ = applied
    fetch = (
        "import sys, urllib.request; r = urllib.request.Request(sys.argv[1]); "
        "sys.argv[2:] and r.add_header('Authorization', 'Basic ' + sys.argv[2]); "
        "print(urllib.request.urlopen(r, timeout=5).read().decode())"
    )

    def get(host: str, url: str, *login: str) -> str:
        return rig.exec(host, ["/usr/bin/python3", "-c", fetch, url, *login]).stdout

    for host in rig.hosts:
        assert "node_cpu_seconds_total" in get("node1", f"http://{host.ip}:9100/metrics")
        assert "rlm_exporter" in get("node1", f"http://{host.ip}:9410/metrics")
    # On the mgmt host's address, with the login the roles generated (the clients' password file).
    password = (rig.host("node1").root / "etc/prometheus/rlm/web/password").read_text()
    login = base64.b64encode(f"rlm-ops:{password}".encode()).decode()
    mgmt = rig.host("node1").ip
    assert "Ready" in get("node1", f"http://{mgmt}:9090/-/ready", login)
    assert "OK" in get("node1", f"http://{mgmt}:9093/-/ready", login)
    rules = json.loads(get("node1", f"http://{mgmt}:9090/api/v1/rules", login))
    assert rules["data"]["groups"], "Prometheus loaded no rule groups"
    targets = rig.host("node1").root / "etc/prometheus/rlm/targets/node.json"
    assert {g["labels"]["host"] for g in json.loads(targets.read_text())} == {"node1", "node2"}

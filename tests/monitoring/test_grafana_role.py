"""The grafana role against this machine: check mode on a bare host (Debian and EL plans), then
for real with the provisioning only, twice (the second run changes nothing).

Grafana is not a Debian package and its vendor repository is not reachable here, so the package,
the grafana-server unit and the health check are planned in check mode only; the provisioning
files it writes are checked against what Grafana's provisioning reads (the bundle's files with
the site's Prometheus URL and dashboard directory)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.ansible.playbook_run import PlaybookRun, run_playbook, write_inventory
from tests.monitoring.test_config import DASHBOARD, MONITORING

PROMETHEUS_URL = "http://10.250.0.1:9090"
# Check mode still asks the key's URL (get_url), which is not reachable here: the controller copy
# an air-gapped site would give (grafana_repo_key_src).
KEY = Path(__file__).parents[1] / "ansible" / "fixtures" / "repo-signing-key.asc"


def run_role(tmp: Path, name: str, host_vars: dict, *, check: bool) -> PlaybookRun:
    work = tmp / name
    work.mkdir(exist_ok=True)
    playbook = work / "grafana.yml"
    playbook.write_text(
        yaml.safe_dump(
            [{"name": "Grafana", "hosts": "mgmt", "gather_facts": False, "roles": ["grafana"]}]
        )
    )
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {"all": {"children": {"mgmt": {"hosts": {"mon": {**local, **host_vars}}}}}}
    result = run_playbook(
        playbook, write_inventory(work / "hosts.yml", inventory), work, check=check
    )
    # Check mode cannot install from a repository it has not written yet (ignored by the role).
    failures = [f for f in result.failures("mon") if not (check and "Install Grafana:" in f)]
    assert result.rc == 0 and not failures, (failures, result.stderr)
    return result


def provisioning_vars(root: Path) -> dict:
    return {
        "grafana_provisioning_dir": str(root / "provisioning"),
        "grafana_dashboards_dir": str(root / "dashboards"),
        "grafana_prometheus_url": PROMETHEUS_URL,
        "grafana_group": "root",
    }


@pytest.mark.parametrize(
    ("os_family", "planned"),
    [
        ("Debian", ["signing key from the controller", "Add Grafana's apt repository (deb822)"]),
        ("RedHat", ["Add Grafana's RPM repository"]),
    ],
)
def test_check_mode_on_a_bare_host_plans_the_repository_package_and_files(
    tmp_path: Path, os_family: str, planned: list[str]
) -> None:
    (tmp_path / "yum.repos.d").mkdir()  # every EL host has it
    host_vars = {
        **provisioning_vars(tmp_path / "root"),
        "rlm_os_family": os_family,
        "grafana_yum_reposdir": str(tmp_path / "yum.repos.d"),
        "grafana_repo_key_src": str(KEY),
    }
    result = run_role(tmp_path, os_family, host_vars, check=True)
    changed = result.changed("mon")
    for task in [*planned, "Provision the Prometheus datasource"]:
        assert any(name.endswith(task) for name in changed), (task, changed)
    assert result.ran("mon", "Install Grafana")
    assert result.ran("mon", "Install the bundle's dashboards")
    assert not result.ran("mon", "Run Grafana")  # the unit comes with the package
    assert not result.ran("mon", "Check Grafana is healthy")
    assert not (tmp_path / "root").exists() and not any((tmp_path / "yum.repos.d").iterdir())


def test_provisioning_applies_then_changes_nothing_and_check_mode_agrees(tmp_path: Path) -> None:
    root = tmp_path / "root"
    host_vars = {
        **provisioning_vars(root),
        "grafana_install_package": False,
        "rlm_os_family": "Debian",
    }
    first = run_role(tmp_path, "first", host_vars, check=False)
    assert first.changed("mon")
    assert not first.ran("mon", "Run Grafana")

    datasources = yaml.safe_load((root / "provisioning/datasources/rlm-ops.yml").read_text())
    shipped = yaml.safe_load((MONITORING / "grafana/provisioning/datasources.yml").read_text())
    assert datasources == {
        "apiVersion": 1,
        "datasources": [{**shipped["datasources"][0], "url": PROMETHEUS_URL}],
    }
    providers = yaml.safe_load((root / "provisioning/dashboards/rlm-ops.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == str(root / "dashboards")
    assert providers["providers"][0]["type"] == "file"
    installed = json.loads((root / "dashboards" / DASHBOARD.name).read_text())
    assert installed == json.loads(DASHBOARD.read_text())

    second = run_role(tmp_path, "second", host_vars, check=False)
    assert second.changed("mon") == []
    planned = run_role(tmp_path, "check", host_vars, check=True)
    assert planned.changed("mon") == []


def test_tls_and_basic_auth_reach_the_datasource_and_stay_out_of_the_output(
    tmp_path: Path,
) -> None:
    """With the site's rlm_monitoring_* settings Grafana reaches Prometheus over HTTPS on the
    mgmt host's address, checks its certificate with the site's CA against the mgmt host's name and logs in;
    the CA and password go to secureJsonData, and no password shows in the play's output."""
    root = tmp_path / "root"
    ca = tmp_path / "site-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB-test-ca\n-----END CERTIFICATE-----\n")
    host_vars = {
        **provisioning_vars(root),
        "grafana_install_package": False,
        "rlm_os_family": "Debian",
        "rlm_monitoring_tls_cert": str(tmp_path / "cert.pem"),
        "rlm_monitoring_tls_ca": str(ca),
        "rlm_monitoring_username": "grafana-reader",
        "rlm_monitoring_password": "pw-for-the-test",
    }
    del host_vars["grafana_prometheus_url"]  # the role's own: https on the mgmt address
    result = run_role(tmp_path, "tls", host_vars, check=False)
    datasource = yaml.safe_load((root / "provisioning/datasources/rlm-ops.yml").read_text())
    [source] = datasource["datasources"]
    # Prometheus listens on the mgmt host's cluster address (no ansible_host here: its name).
    assert source["url"] == "https://mon:9090"
    assert source["jsonData"]["serverName"] == "mon"  # the inventory name by default
    assert source["jsonData"]["tlsAuthWithCACert"] is True
    assert source["jsonData"]["timeInterval"] == "15s"  # the bundle's settings stay
    assert source["basicAuth"] is True and source["basicAuthUser"] == "grafana-reader"
    assert source["secureJsonData"] == {
        "tlsCACert": ca.read_text().rstrip("\n"),
        "basicAuthPassword": "pw-for-the-test",
    }
    assert "pw-for-the-test" not in json.dumps(result.report) + result.stderr

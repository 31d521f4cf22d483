"""Prometheus rules, config, Alertmanager and Grafana checked with the real Prometheus tools."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from monitoring import file_sd
from rlmctl.inventory import load

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
RULES = sorted((MONITORING / "prometheus" / "rules").glob("*.yml"))
RULE_TESTS = sorted((MONITORING / "prometheus" / "tests").glob("*.yml"))
DASHBOARD = MONITORING / "grafana" / "dashboards" / "rlm.json"
RUNBOOKS = ROOT / "docs" / "runbooks.md"

pytestmark = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("promtool", "amtool")),
    reason="needs promtool and amtool (Debian: prometheus, prometheus-alertmanager)",
)


def run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def rules() -> list[dict]:
    return [
        rule
        for path in RULES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    ]


def alerts() -> list[dict]:
    return [rule for rule in rules() if "alert" in rule]


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        target["expr"]
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def as_plain_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced by what they expand to."""
    return (
        expr.replace("$__rate_interval", "1m").replace('"$run"', '".*"').replace('"$host"', '".*"')
    )


def test_promtool_check_rules() -> None:
    output = run("promtool", "check", "rules", *RULES).stdout
    assert output.count("SUCCESS") == len(RULES)


@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_promtool_rule_unit_tests(test_file: Path) -> None:
    run("promtool", "test", "rules", test_file)


def test_every_alert_is_labelled_annotated_and_has_a_runbook_section() -> None:
    anchors = {
        re.sub(r"[^a-z0-9-]", "", line[3:].strip().lower().replace(" ", "-"))
        for line in RUNBOOKS.read_text().splitlines()
        if line.startswith("## ")
    }
    assert len(alerts()) >= 18
    for alert in alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning", "info"), name
        assert alert["labels"]["component"], name
        annotations = alert["annotations"]
        assert annotations["summary"] and annotations["description"], name
        assert annotations["runbook_url"] == f"docs/runbooks.md#{name.lower()}", name
        assert name.lower() in anchors, f"docs/runbooks.md has no section for {name}"


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    firing, silent = set(), set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check["exp_alerts"] else silent).add(check["alertname"])
                for expected in check["exp_alerts"]:
                    assert expected["exp_labels"]["severity"], check["alertname"]
                    assert set(expected["exp_annotations"]) == {
                        "summary",
                        "description",
                        "runbook_url",
                    }, check["alertname"]
    names = {alert["alert"] for alert in alerts()}
    assert names - firing == set(), "alerts without a test where they fire"
    assert names - silent == set(), "alerts without a test where they must not fire"


def write_inventory(path: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "children": {
                        "mgmt": {"hosts": {"head": {"ansible_host": "10.1.0.1"}}},
                        "compute": {
                            "hosts": {
                                "gpu1": {"ansible_host": "10.1.0.11", "rlm_gpu_vendor": "nvidia"},
                                "gpu2": {"ansible_host": "10.1.0.12", "rlm_gpu_vendor": "amd"},
                                "gpu3": {"ansible_host": "10.1.0.13", "rlm_gpu_vendor": "nvidia"},
                            }
                        },
                        "drained": {"hosts": {"gpu3": {}}},
                    },
                    "vars": {"ansible_connection": "local"},
                }
            }
        )
    )
    return path


def test_file_sd_targets_from_the_inventory(tmp_path: Path) -> None:
    jobs = file_sd.target_groups(load(write_inventory(tmp_path / "hosts.yml")))
    by_host = {job: {g["labels"]["host"]: g for g in groups} for job, groups in jobs.items()}
    assert by_host["node"]["head"] == {"targets": ["10.1.0.1:9100"], "labels": {"host": "head"}}
    assert set(by_host["rlm-exporter"]) == {"head", "gpu1", "gpu2", "gpu3"}
    assert by_host["dcgm"]["gpu1"]["targets"] == ["10.1.0.11:9400"]
    assert set(by_host["dcgm"]) == {"gpu1", "gpu3"}
    assert by_host["amd-device-metrics"]["gpu2"]["targets"] == ["10.1.0.12:5000"]
    assert set(by_host["amd-device-metrics"]) == {"gpu2"}
    assert set(by_host["rlm-trainer"]) == {"gpu1", "gpu2", "gpu3"}
    assert by_host["dcgm"]["gpu3"]["labels"] == {"host": "gpu3", "drained": "true"}
    assert by_host["node"]["gpu1"]["labels"] == {"host": "gpu1"}


def test_file_sd_bad_inventory_is_one_line_error(tmp_path: Path) -> None:
    code = file_sd.main(["--inventory", str(tmp_path / "missing.yml"), "--out", str(tmp_path)])
    assert code == 2
    assert not list(tmp_path.glob("*.json"))


def render_prometheus(tmp_path: Path) -> Path:
    """The shipped prometheus.yml with rules/ and targets/ beside it, as installed."""
    config_dir = tmp_path / "prometheus"
    shutil.copytree(MONITORING / "prometheus", config_dir, ignore=shutil.ignore_patterns("tests"))
    inventory = load(write_inventory(tmp_path / "hosts.yml"))
    file_sd.write_targets(file_sd.target_groups(inventory), config_dir / "targets")
    return config_dir / "prometheus.yml"


def test_promtool_check_config_on_the_rendered_config(tmp_path: Path) -> None:
    output = run("promtool", "check", "config", render_prometheus(tmp_path)).stdout
    assert f"SUCCESS: {len(RULES)} rule files found" in output


def test_amtool_check_config() -> None:
    output = run("amtool", "check-config", MONITORING / "alertmanager" / "alertmanager.yml").stdout
    assert "SUCCESS" in output and "2 inhibit rules" in output


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 20
    # promtool has no "check expression": every query becomes a recording rule it parses.
    as_rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": as_plain_promql(q)}
                    for i, q in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(as_rules))
    assert f"SUCCESS: {len(queries)} rules found" in run("promtool", "check", "rules", path).stdout


def test_dashboard_uses_only_defined_recording_rules_and_shows_the_run_and_cluster() -> None:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    used = {name for q in dashboard_queries() for name in re.findall(r"rlm:[a-z0-9_:]+", q)}
    assert used <= recorded
    titles = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    for expected in ("Loss", "Tokens/s", "MFU", "Checkpoint age", "Recurrence depth"):
        assert expected in titles
    assert "Validation perplexity per recurrence depth" in titles


def test_trainer_metric_names_match_the_architecture_contract() -> None:
    contract = set(
        re.findall(r"rlm_train_[a-z_]+", (ROOT / "docs" / "architecture.md").read_text())
    )
    texts = [path.read_text() for path in RULES] + [DASHBOARD.read_text()]
    used = {name for text in texts for name in re.findall(r"rlm_train_[a-z_]+", text)}
    assert used and used <= contract

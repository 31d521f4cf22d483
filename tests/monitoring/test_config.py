"""Prometheus rules, config, Alertmanager and Grafana checked with the real Prometheus tools."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clusterspec.variables import default
from clusterspec.vendors import nvidia
from monitoring import file_sd
from rlmctl.inventory import load

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
RULES = sorted((MONITORING / "prometheus" / "rules").glob("*.yml"))
RULE_TESTS = sorted((MONITORING / "prometheus" / "tests").glob("*.yml"))
DASHBOARD = MONITORING / "grafana" / "dashboards" / "rlm.json"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_BASE_URL = default("rlm_runbook_base_url")

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


def annotation_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [a["expr"] for a in dashboard["annotations"]["list"]]


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
        assert alert["labels"]["severity"] in ("critical", "warning", "info", "none"), name
        assert alert["labels"]["component"], name
        annotations = alert["annotations"]
        assert annotations["summary"] and annotations["description"], name
        assert annotations["runbook_url"] == f"{RUNBOOK_BASE_URL}#{name.lower()}", name
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
    # Watchdog exists to fire always: it has no case where it must not.
    assert names - silent == {"Watchdog"}, "alerts without a test where they must not fire"


def test_every_critical_meta_alert_waits_out_a_blip() -> None:
    """A critical alert about the monitoring itself pages on a failure that lasts, not on one
    failed evaluation or notification (the blip cases in tests/meta.yml time each `for:`)."""
    meta = yaml.safe_load((MONITORING / "prometheus" / "rules" / "meta.yml").read_text())
    critical = [
        rule
        for group in meta["groups"]
        for rule in group["rules"]
        if rule.get("labels", {}).get("severity") == "critical"
    ]
    assert len(critical) >= 5
    assert [r["alert"] for r in critical if not r.get("for")] == []


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
    assert by_host["dcgm"]["gpu3"]["labels"] == {"host": "gpu3", "job": "dcgm", "drained": "true"}
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
    assert "SUCCESS" in output and "3 inhibit rules" in output


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    queries = dashboard_queries() + annotation_queries()
    assert len(queries) >= 24
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


# A query over a series per GPU (or per interface) draws one line each: 32,768 at 4096 nodes x 8.
PER_DEVICE = re.compile(r"rlm:gpu_|rlm_gpu_|network_|rdma_")
BOUNDED = re.compile(r"(topk|bottomk)\(\d+, |(quantile|count_values)\(|(min|max)\(|max by \(run\) ")


def test_per_gpu_panels_draw_a_bounded_number_of_series() -> None:
    unbounded = [q for q in dashboard_queries() if PER_DEVICE.search(q) and not BOUNDED.match(q)]
    assert unbounded == []
    dashboard = json.loads(DASHBOARD.read_text())
    heatmaps = [p for p in dashboard["panels"] if p["type"] == "heatmap"]
    assert {t["expr"].split("(")[0] for p in heatmaps for t in p["targets"]} == {"count_values"}


def test_annotations_mark_launches_restarts_checkpoints_and_failures() -> None:
    """From the series the exporter writes from events.jsonl (test_exporter.py shows them)."""
    annotations = json.loads(DASHBOARD.read_text())["annotations"]["list"]
    assert [a["name"] for a in annotations] == ["Launches", "Restarts", "Checkpoints", "Failures"]
    kinds = {
        a["name"]: set(m[0].split("|"))
        if (m := re.findall(r'event=~"([a-z_|]+)"', a["expr"]))
        else set()
        for a in annotations
    }
    assert kinds["Launches"] == {"launched"} and kinds["Checkpoints"] == {"checkpoint"}
    assert {"failure", "launch_failed", "checkpoint_failed"} <= kinds["Failures"]
    from runcontract.states import EventKind

    assert set().union(*kinds.values()) <= {k.value for k in EventKind}
    assert "rlm_run_restarts_total" in annotations[1]["expr"]
    for annotation in annotations:
        assert annotation["enable"] and '{run=~"$run"' in annotation["expr"], annotation["name"]


def test_trainer_metric_names_match_the_architecture_contract() -> None:
    contract = set(
        re.findall(r"rlm_train_[a-z_]+", (ROOT / "docs" / "architecture.md").read_text())
    )
    texts = [path.read_text() for path in RULES] + [DASHBOARD.read_text()]
    used = {name for text in texts for name in re.findall(r"rlm_train_[a-z_]+", text)}
    assert used and used <= contract


def test_hardware_xid_codes_in_the_rules_are_the_vendor_descriptions() -> None:
    """GpuXidCritical/GpuXidErrors split on nvidia.XID_CRITICAL, the health gate's own list."""
    by_name = {alert["alert"]: alert["expr"] for alert in alerts()}
    for name, operator in (("GpuXidCritical", "=~"), ("GpuXidErrors", "!~")):
        codes = re.findall(r"xid" + operator + r'"([0-9|]+)"', by_name[name])
        assert codes, name
        assert all({int(c) for c in found.split("|")} == nvidia.XID_CRITICAL for found in codes)


def test_every_scrape_job_that_always_has_targets_is_watched_by_absent() -> None:
    config = yaml.safe_load((MONITORING / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    expr = next(a["expr"] for a in alerts() if a["alert"] == "ScrapeJobMissing")
    watched = set(re.findall(r'absent\(up\{job="([a-z-]+)"\}\)', expr))
    # gpu-exporter has targets only on sites with a vendor exporter; rlm-trainer's are down by
    # design except rank 0 (TrainingStalled watches runs instead).
    assert watched == jobs - {"gpu-exporter", "rlm-trainer"}


def test_rule_files_rendered_with_the_site_runbook_base(tmp_path: Path) -> None:
    from monitoring import rule_files

    base = "https://wiki.example.org/ops/runbooks"
    assert rule_files.main(["--runbook-base-url", base, "--out", str(tmp_path)]) == 0
    rendered = [
        rule
        for path in sorted(tmp_path.glob("*.yml"))
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]
    assert len(rendered) == len(alerts())
    for alert in rendered:
        assert alert["annotations"]["runbook_url"] == f"{base}#{alert['alert'].lower()}"
    assert run("promtool", "check", "rules", *sorted(tmp_path.glob("*.yml"))).returncode == 0


def test_rule_files_refuse_a_relative_runbook_base(tmp_path: Path, capsys) -> None:
    from monitoring import rule_files

    assert rule_files.main(["--runbook-base-url", "docs/runbooks.md", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rlm_runbook_base_url" in err
    assert not list(tmp_path.glob("*.yml"))


ALL_RECEIVERS = {
    "rlm_alert_webhook_url": "http://10.1.0.1:8080/alerts",
    "rlm_alert_watchdog_url": "https://deadman.example.org/ping/abc",
    "rlm_alert_slack_api_url": "https://hooks.slack.com/services/T0/B0/secret",
    "rlm_alert_slack_channel": "#gpu-cluster",
    "rlm_alert_email_to": "oncall@example.org",
    "rlm_alert_email_from": "alertmanager@example.org",
    "rlm_alert_smtp_smarthost": "smtp.example.org:587",
    "rlm_alert_smtp_username": "alertmanager",
    "rlm_alert_smtp_password": "s3cret",
    "rlm_alert_pagerduty_routing_key": "0123456789abcdef0123456789abcdef",
}


def render_alertmanager(
    tmp_path: Path, settings: dict, monkeypatch
) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "alertmanager.yml"
    return subprocess.run(
        [sys.executable, "-m", "monitoring.alertmanager_config", "--out", str(out)],
        input=json.dumps(settings),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )


def test_alertmanager_receivers_from_the_inventory_pass_amtool(tmp_path, monkeypatch) -> None:
    result = render_alertmanager(tmp_path, ALL_RECEIVERS, monkeypatch)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "alertmanager.yml"
    assert "SUCCESS" in run("amtool", "check-config", out).stdout
    by_name = {r["name"]: r for r in yaml.safe_load(out.read_text())["receivers"]}
    pager, team = by_name["pager"], by_name["team"]
    assert (
        pager["pagerduty_configs"][0]["routing_key"]
        == ALL_RECEIVERS["rlm_alert_pagerduty_routing_key"]
    )
    assert "pagerduty_configs" not in team  # warnings never page
    for receiver in (pager, team):
        assert receiver["webhook_configs"][0] == {
            "url": ALL_RECEIVERS["rlm_alert_webhook_url"],
            "send_resolved": True,
        }
        assert receiver["slack_configs"][0]["channel"] == "#gpu-cluster"
        assert "runbook_url" in receiver["slack_configs"][0]["text"]
        assert receiver["email_configs"][0]["auth_password"] == "s3cret"
    assert (
        by_name["watchdog"]["webhook_configs"][0]["url"] == ALL_RECEIVERS["rlm_alert_watchdog_url"]
    )
    assert out.stat().st_mode & 0o077 == 0o040  # secrets: not world-readable
    # Routing: the Watchdog reaches only its receiver; critical pages; drained-host info nowhere.
    for labels, receiver in (
        ("alertname=Watchdog severity=none", "watchdog"),
        ("alertname=GpuXidCritical severity=critical", "pager"),
        ("alertname=GpuXidErrors severity=warning", "team"),
        ("alertname=HostDrained severity=info", "blackhole"),
    ):
        routed = run("amtool", "config", "routes", "test", "--config.file", out, *labels.split())
        assert routed.stdout.strip() == receiver, labels


def test_alertmanager_without_receivers_still_passes_amtool(tmp_path, monkeypatch) -> None:
    assert render_alertmanager(tmp_path, {}, monkeypatch).returncode == 0
    assert "SUCCESS" in run("amtool", "check-config", tmp_path / "alertmanager.yml").stdout


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"rlm_alert_slack_api_url": "https://hooks.slack.com/x"}, "rlm_alert_slack_channel"),
        ({"rlm_alert_email_to": "a@example.org"}, "rlm_alert_email_from"),
    ],
)
def test_incomplete_receiver_settings_are_one_line_errors(tmp_path, monkeypatch, settings, named):
    result = render_alertmanager(tmp_path, settings, monkeypatch)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and named in result.stderr
    assert not (tmp_path / "alertmanager.yml").exists()
    assert "hooks.slack.com" not in result.stderr  # no secret in the message


@pytest.mark.playbook
def test_site_refuses_an_alertmanager_without_receiver_before_any_change(tmp_path: Path) -> None:
    """An Alertmanager with no receiver accepts every alert and delivers none (amtool passes it):
    preflight names the variables on the mgmt host that has none; a Watchdog URL alone does not
    count; a receiver or the explicit opt-out passes."""
    from tests.ansible.playbook_run import run_playbook, write_inventory

    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_host": "127.0.0.1",
    }
    hosts = {
        "silent": local,
        "watchdog_only": {**local, "rlm_alert_watchdog_url": "https://deadman.example.org/p/1"},
        "webhook": {**local, "rlm_alert_webhook_url": "http://10.0.0.1:8080/alerts"},
        "opted_out": {**local, "rlm_alert_allow_no_receiver": True},
    }
    inventory = {
        "all": {
            "children": {"mgmt": {"hosts": hosts}},
            "vars": {"rlm_gpu_vendor": "none", "rlm_gpus_per_node": 0, "rlm_shared_fs": "none"},
        }
    }
    run = run_playbook(
        "preflight.yml",
        write_inventory(tmp_path / "hosts.yml", inventory),
        tmp_path,
        check=True,
        skip_tags="reachability",  # this machine reaches no index (test_validate tries that)
    )
    assert run.rc != 0
    for host in ("silent", "watchdog_only"):
        [failure] = run.failures(host)
        assert failure.count("\n") == 0, failure
        assert (
            f"Alertmanager on {host} would deliver alerts to no one: set rlm_alert_webhook_url, "
            "rlm_alert_slack_api_url, rlm_alert_email_to or rlm_alert_pagerduty_routing_key"
        ) in failure
        assert "rlm_alert_allow_no_receiver: true" in failure
    for host in ("webhook", "opted_out"):
        assert run.ran(host, "Check Alertmanager has a receiver for critical and warning alerts")
        [failure] = run.failures(host)  # only the final "some host failed validation" stop
        assert "validation failed on silent, watchdog_only" in failure


def test_the_shipped_dcgm_counters_carry_every_dcgm_field_the_rules_read() -> None:
    """dcgm-exporter's default counters leave out the XID count, double-bit ECC, a pending row
    remap and NVLink errors: a dcgm-only site had no XID or ECC alert."""
    lines = (MONITORING / "dcgm" / "rlm-counters.csv").read_text().splitlines()
    rows = [[cell.strip() for cell in line.split(",", 2)] for line in lines]
    rows = [row for row in rows if row[0] and not row[0].startswith("#")]
    assert all(len(row) == 3 and row[1] in ("gauge", "counter", "label") for row in rows), rows
    shipped = {row[0] for row in rows}
    read = {
        name
        for path in RULES
        for name in re.findall(r"DCGM_(?:FI|EXP)_[A-Z0-9_]+", path.read_text())
    }
    # The NVLink totals are selected by one regex in the rules.
    read |= {
        f"DCGM_FI_DEV_NVLINK_{kind}_ERROR_COUNT_TOTAL"
        for kind in ("CRC_FLIT", "CRC_DATA", "REPLAY", "RECOVERY")
    }
    read.discard("DCGM_FI_DEV_NVLINK_")
    # DCGM before 3.3 names the clock event mask CLOCK_THROTTLE_REASONS: the rules read both.
    assert read - shipped == {"DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"}, read - shipped
    assert {"DCGM_EXP_XID_ERRORS_COUNT", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"} <= shipped
    assert {"DCGM_FI_DEV_ROW_REMAP_PENDING", "DCGM_FI_DEV_ROW_REMAP_FAILURE"} <= shipped


def test_the_alerting_tunables_are_the_acceptance_thresholds() -> None:
    """LearningRateJump and RunLogsNotGrowing are rlmctl accept's criteria as alerts: one threshold."""
    tunables = {
        rule["record"]: float(re.fullmatch(r"vector\((.+)\)", rule["expr"])[1])
        for rule in rules()
        if rule.get("record", "").startswith("rlm:tunable_")
    }
    accept = default("rlm_accept_thresholds")
    assert tunables["rlm:tunable_lr_max_step_change_ratio"] == accept["lr_max_jump"]
    assert tunables["rlm:tunable_log_max_age_seconds"] == accept["log_max_age_s"]


@pytest.mark.playbook
def test_the_gpu_exporter_role_plans_dcgm_exporter_with_the_shipped_counters(
    tmp_path: Path,
) -> None:
    """No NVIDIA package or GPU here: check mode plans the counters file and the unit's drop-in
    (the collectors and a 15-minute XID window, the rules' window) on an NVIDIA host."""
    from tests.ansible.playbook_run import FAKE_VENDOR_BIN, run_playbook, write_inventory

    playbook = tmp_path / "gpu-exporter.yml"
    play = {"name": "GPU exporter", "hosts": "compute", "gather_facts": False}
    playbook.write_text(yaml.safe_dump([{**play, "roles": ["gpu_exporter"]}]))
    host = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "rlm_gpu_vendor": "nvidia",
        "rlm_gpus_per_node": 8,
        "rlm_init_system": "systemd",
        "gpu_detect_module_dirs": {"nvidia": "/sys/module/kernel"},
    }
    inventory = write_inventory(
        tmp_path / "hosts.yml", {"all": {"children": {"compute": {"hosts": {"gpu1": host}}}}}
    )
    run = run_playbook(
        playbook,
        inventory,
        tmp_path,
        check=True,
        env={"PATH": f"{FAKE_VENDOR_BIN}:{os.environ['PATH']}"},
    )
    # Check mode cannot install a package from a repository it has not written, nor start the
    # service it would bring: the role ignores both there.
    ignored = ("Install the exporter packages", "Enable and start the exporter services")
    failures = [f for f in run.failures("gpu1") if not any(task in f for task in ignored)]
    assert failures == [], failures
    dropin = run.task("gpu1", "Run the exporter with them and a 15-minute XID window")
    diff = dropin.result["diff"]
    after = "".join(d.get("after", "") for d in (diff if isinstance(diff, list) else [diff]))
    assert "ExecStart=\nExecStart=/usr/bin/dcgm-exporter --collectors " in after
    assert "/etc/dcgm-exporter/rlm-counters.csv --xid-count-window-size 900000" in after
    counters = run.task("gpu1", "Install the collectors (XID count, ECC, row remap, NVLink errors)")
    assert counters.changed and not (tmp_path / "etc").exists()

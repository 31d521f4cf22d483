"""The prometheus role's command line run for real: no lifecycle/admin API, reload by SIGHUP."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import jinja2
import pytest
import yaml

from clusterspec import vendors
from tests.monitoring.conftest import wait_for
from tests.monitoring.test_config import render_prometheus
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "prometheus"

pytestmark = pytest.mark.skipif(
    not shutil.which("prometheus"), reason="needs Debian's prometheus package"
)


def role_argv(**variables: str) -> list[str]:
    """rlm_service_exec of the role's "Run Prometheus" task, rendered with `variables`."""
    tasks = yaml.safe_load((ROLE / "tasks" / "main.yml").read_text())
    task = next(t for t in tasks if t["name"] == "Run Prometheus")
    assert task["vars"]["rlm_service_reload_signal"] == "HUP"
    return [jinja2.Template(arg).render(**variables) for arg in task["vars"]["rlm_service_exec"]]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def post(url: str) -> tuple[int, str]:
    request = urllib.request.Request(url, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def reloads(base: str) -> float:
    """prometheus_config_last_reload_success_timestamp_seconds from its own /metrics."""
    _, text = get(f"{base}/metrics")
    line = next(
        line for line in text.splitlines()
        if line.startswith("prometheus_config_last_reload_success_timestamp_seconds ")
    )  # fmt: skip
    return float(line.split()[1])


def test_lifecycle_and_admin_endpoints_are_off_and_sighup_reloads(tmp_path: Path) -> None:
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1m}\n")
    # What roles/monitoring_web writes with TLS and basic auth off (the default): plain HTTP.
    (tmp_path / "web-config.yml").write_text("{}\n")
    listen = f"127.0.0.1:{free_port()}"
    argv = role_argv(
        prometheus_binary=shutil.which("prometheus"),
        prometheus_config_dir=str(tmp_path),
        prometheus_web_dir=str(tmp_path),
        prometheus_storage_dir=str(tmp_path / "data"),
        prometheus_retention="1d",
        prometheus_listen=listen,
    )
    assert not any("enable-lifecycle" in a or "enable-admin-api" in a for a in argv)
    assert f"--web.config.file={tmp_path / 'web-config.yml'}" in argv
    base = f"http://{listen}"
    with open(tmp_path / "log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: get(f"{base}/-/ready")[0] == 200, 60, "Prometheus ready")
        for endpoint in ("reload", "quit"):
            assert post(f"{base}/-/{endpoint}") == (403, "Lifecycle API is not enabled.")
        status, body = post(f"{base}/api/v1/admin/tsdb/delete_series?match[]=up")
        assert status != 200 and "admin APIs disabled" in body, body
        first = reloads(base)
        config.write_text("global: {scrape_interval: 30s}\n")
        os.kill(process.pid, signal.SIGHUP)  # what the unit's ExecReload sends
        wait_for(lambda: reloads(base) > first, 30, "a reload after SIGHUP")
        assert "30s" in get(f"{base}/api/v1/status/config")[1]
        assert process.poll() is None
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_vendor_exporters_keep_their_job_label_in_the_one_gpu_job(tmp_path: Path) -> None:
    """prometheus.yml names no vendor: its gpu-exporter job reads every gpu-<job>.json, and a
    real Prometheus keeps each target's job label (what rules and dashboards select on)."""
    config = render_prometheus(tmp_path)
    listen = f"127.0.0.1:{free_port()}"
    argv = [
        shutil.which("prometheus"), f"--config.file={config}", f"--web.listen-address={listen}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
    ]  # fmt: skip
    base = f"http://{listen}"
    with open(tmp_path / "log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: get(f"{base}/-/ready")[0] == 200, 60, "Prometheus ready")

        def gpu_jobs() -> set[tuple[str, str]]:
            targets = json.loads(get(f"{base}/api/v1/targets")[1])["data"]["activeTargets"]
            return {
                (t["scrapePool"], t["labels"]["job"])
                for t in targets
                if t["scrapePool"] == "gpu-exporter"
            }

        expected = {("gpu-exporter", v.EXPORTER_JOB[0]) for v in vendors.VENDORS.values()}
        wait_for(lambda: gpu_jobs() == expected, 30, f"targets of {sorted(expected)}")
    finally:
        process.terminate()
        process.wait(timeout=30)

"""Health checks without the rig: the host script's verdicts on this machine (local connection)
and its parsers on vendor-tool output in the tools' documented formats."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from clusterspec import vendors
from clusterspec.vendors import nvidia
from monitoring import gpu
from rlmctl import health, hostcheck, inventory
from rlmctl.health import CRIT, OK, UNKNOWN, WARN, Check, HostHealth
from rlmctl.remote import Fleet
from tests.monitoring.conftest import install_tool
from tests.monitoring.nvidia_smi_standin import RECORDED_FIELDS
from tests.rlmctl.conftest import rlmctl

THRESHOLDS = health.THRESHOLDS

FIXTURES = Path(__file__).parents[1] / "monitoring" / "fixtures"
# Recorded on an 8× H100 node with the exporter's field list before `name`/`driver_version`.
RECORDED = (FIXTURES / "nvidia-smi-8gpu.csv").read_text()
KERNEL_LOG = (FIXTURES / "dmesg-xid.txt").read_text()


def test_local_host_passes_the_gate(local_inventory: Path) -> None:
    hosts = inventory.load(local_inventory).select()
    with Fleet(hosts) as fleet:
        report = health.run_checks(fleet)
    (host,) = report.hosts
    names = [c.name for c in host.checks]
    checks = ("reachable", "clock", "disk", "shared_fs", "memory", "load", "gpu", "topology")
    for name in (*checks, "rdzv_port"):
        assert name in names
    assert host.check("shared_fs").state == OK  # the controller's marker was seen
    assert host.check("gpu").detail.startswith("skipped")
    assert host.check("python_env").state == OK and host.env["torch"].startswith("2.")
    assert report.state in (OK, WARN)  # load may be high on a busy machine; never CRIT
    assert not list((local_inventory.parent / "shared" / ".rlmctl").iterdir())  # marker removed


@pytest.mark.integration
def test_cli_health_json_exit_codes(local_inventory: Path) -> None:
    result = rlmctl("-i", str(local_inventory), "health", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["hosts"][0]["host"] == "localhost"
    # The report is kept for `rlmctl accept` (topology; with --deep the communication path).
    kept = health.read_last_report(str(local_inventory.parent / "shared"))
    assert kept["hosts"][0]["host"] == "localhost" and kept["time"] > 0
    port = inventory.load(local_inventory).select()[0].rdzv_port
    with socket.socket() as busy:  # the rendezvous port taken: critical, exit 1
        busy.bind(("0.0.0.0", port))
        busy.listen()
        result = rlmctl("-i", str(local_inventory), "health", "--json")
    assert result.returncode == 1
    checks = json.loads(result.stdout)["hosts"][0]["checks"]
    check = next(c for c in checks if c["name"] == "rdzv_port")
    assert check["state"] == CRIT and str(port) in check["detail"] and "rlmctl stop" in check["fix"]


def _cfg(tmp_path: Path, **extra) -> dict:
    cfg = {"shared_dir": str(tmp_path), "marker": "m", "token": "t0k", "thresholds": THRESHOLDS}
    return cfg | extra


def test_shared_fs_without_the_controllers_marker_is_critical(tmp_path: Path) -> None:
    assert hostcheck.check_shared_fs(_cfg(tmp_path))["state"] == CRIT
    (tmp_path / "m").write_text("t0k")
    assert hostcheck.check_shared_fs(_cfg(tmp_path))["state"] == OK
    missing = hostcheck.check_disk(_cfg(tmp_path / "absent"))
    assert missing["state"] == CRIT and "does not exist" in missing["detail"]
    assert hostcheck.check_disk(_cfg(tmp_path))["state"] in (OK, WARN)


def test_disk_thresholds(tmp_path: Path) -> None:
    strict = THRESHOLDS | {"disk_warn_pct": 0, "disk_crit_pct": 0}
    result = hostcheck.check_disk(_cfg(tmp_path, thresholds=strict))
    assert result["state"] == CRIT and "full" in result["detail"]


def test_gpu_verdicts_from_the_exporters_parser() -> None:
    """The gate judges what the one nvidia-smi parser (shared with the exporter) read."""
    gpus = nvidia.parse_nvidia_smi(RECORDED, RECORDED_FIELDS).gpus
    assert hostcheck.judge_gpus(gpus[:4], 8, THRESHOLDS)["detail"].startswith("4 GPUs visible")
    ecc = hostcheck.judge_gpus(gpus, 8, THRESHOLDS)  # GPU 7 has an uncorrected ECC error
    assert ecc["state"] == CRIT and "ECC" in ecc["detail"] and "[7]" in ecc["detail"]
    clean = [replace(g, ecc_uncorrected_total=0.0) for g in gpus]
    assert hostcheck.judge_gpus(clean, 8, THRESHOLDS)["state"] == OK
    hot = [replace(clean[0], temperature_celsius=88.0), *clean[1:]]
    warm = hostcheck.judge_gpus(hot, 8, THRESHOLDS)
    assert warm["state"] == WARN and "88 C" in warm["detail"]


def test_auto_vendor_on_a_host_with_vendor_tools_but_no_gpu_driver_is_no_gpu_node(
    tmp_path: Path, monkeypatch
) -> None:
    """The real /sys/module of a host without GPUs, and both AMD tools installed (as ROCm's
    userland is on login nodes; CI's Makefile installs the real rocm-smi): no GPU node. Detecting
    by the tool took such a host for an AMD node, and its gate went CRIT on rocm-smi's error."""
    loaded = [name for name in vendors.VENDORS if vendors.driver_loaded(name)]
    if loaded:
        pytest.skip(f"this host has a GPU driver loaded ({loaded})")
    bin_dir = tmp_path / "bin"
    for tool in ("amd-smi", "rocm-smi"):
        install_tool(bin_dir, tool, "echo 'ERROR: Driver not initialized' >&2; exit 1")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    cfg = _cfg(tmp_path, vendor="auto", gpus=8)
    assert vendors.detect_vendor() == "none" and vendors.detect_tool() is None
    assert gpu.detect_source() is None
    assert hostcheck.check_gpu(cfg) == hostcheck.check(
        "gpu", OK, "skipped (rlm_gpu_vendor=auto, no GPU driver)"
    )
    assert hostcheck.check_gpu_xid(cfg)["detail"].startswith("skipped")


def test_auto_vendor_with_a_driver_loaded_but_no_tool_is_critical(
    tmp_path: Path, monkeypatch, gpu_drivers_loaded: Path
) -> None:
    """A GPU node whose vendor tool is missing is a broken GPU node, not a CPU host."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no tool at all
    assert vendors.detect_vendor() == "nvidia" and vendors.detect_tool() is None
    result = hostcheck.check_gpu(_cfg(tmp_path, vendor="auto", gpus=8))
    assert result["state"] == CRIT and "nvidia driver" in result["fix"], result


def test_gate_and_exporter_run_the_same_tool_for_amd(
    tmp_path: Path, monkeypatch, gpu_drivers_loaded: Path
) -> None:
    """amd-smi when installed (rocm-smi only without it), read by the same parser."""
    (gpu_drivers_loaded / nvidia.KERNEL_MODULE).rmdir()  # an AMD node
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "amd-smi"
    tool.write_text(f"#!/bin/sh\ncat '{FIXTURES / 'amd-smi-metric-8gpu.json'}'\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert vendors.detect_tool() == gpu.detect_source() == "amd-smi"
    result = hostcheck.check_gpu(_cfg(tmp_path, vendor="auto", gpus=8))
    assert result["detail"].startswith("8× GPU"), result
    assert hostcheck.check_gpu(_cfg(tmp_path, vendor="amd", gpus=4))["state"] == CRIT


def test_xid_verdicts() -> None:
    codes = [c for events in nvidia.xid_events(KERNEL_LOG).values() for c, _ in events]
    assert nvidia.judge_xids(codes)[0] == CRIT
    assert nvidia.judge_xids([13])[0] == WARN
    assert nvidia.judge_xids([])[0] == OK


def test_a_crashing_check_keeps_its_name_and_place(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, gpus=8, rdzv_port=0, python="/nonexistent/python")
    del cfg["thresholds"]  # every check that reads thresholds or the vendor raises KeyError
    script = health._script()
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cfg)], capture_output=True, text=True, check=True
    )
    checks = json.loads(out.stdout)["checks"]
    assert [c["name"] for c in checks] == [
        "disk",
        "shared_fs",
        "memory",
        "load",
        "gpu",
        "gpu_xid",
        "topology",
        "python_env",
    ]
    assert checks[5]["state"] == UNKNOWN and "KeyError" in checks[5]["detail"]


def test_clock_skew_is_bounded_by_the_round_trip() -> None:
    assert health.judge_clock(100.5, 100.0, 101.0).state == OK  # inside the round trip
    assert health.judge_clock(103.0, 100.0, 101.0).state == WARN
    late = health.judge_clock(40.0, 100.0, 101.0)
    assert late.state == CRIT and late.detail.startswith("-60.00")


def test_environment_mismatch_marks_the_minority_critical() -> None:
    env = {"python": "3.11.7", "trainer": "0.1.0", "torch": "2.13.0", "freeze_sha": "aaa"}
    hosts = []
    for name, sha in (("n1", "aaa"), ("n2", "aaa"), ("n3", "bbb")):
        host = HostHealth(name, [Check("python_env", OK, "")], env=env | {"freeze_sha": sha})
        hosts.append(host)
    health.judge_env(hosts)
    assert [h.check("python_env").state for h in hosts] == [OK, OK, CRIT]
    assert "bbb" in hosts[2].check("python_env").detail


def test_worst_state_follows_nagios_precedence() -> None:
    assert health.worst([OK, UNKNOWN]) == UNKNOWN
    assert health.worst([UNKNOWN, WARN]) == WARN
    assert health.worst([WARN, CRIT, OK]) == CRIT
    assert health.worst([]) == OK

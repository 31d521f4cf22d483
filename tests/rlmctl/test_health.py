"""Health checks without the rig: the host script's verdicts on this machine (local connection)
and its parsers on vendor-tool output in the tools' documented formats."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from rlmctl import health, hostcheck, inventory
from rlmctl.health import CRIT, OK, UNKNOWN, WARN, Check, HostHealth
from rlmctl.remote import Fleet
from tests.rlmctl.conftest import rlmctl

THRESHOLDS = health.THRESHOLDS

# `nvidia-smi --query-gpu=index,name,driver_version,temperature.gpu,
#  ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits` (hand-written, documented format)
NVIDIA_SMI = """0, NVIDIA H100 80GB HBM3, 550.54.15, 34, 0
1, NVIDIA H100 80GB HBM3, 550.54.15, 36, 0
2, NVIDIA H100 80GB HBM3, 550.54.15, 33, 2
3, NVIDIA H100 80GB HBM3, 550.54.15, 88, 0
"""
KERNEL_LOG = """NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15
NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, name=python, Graphics Exception
NVRM: Xid (PCI:0000:86:00): 79, pid=0, name=, GPU has fallen off the bus.
"""
ROCM_SMI = json.dumps(
    {
        "card0": {
            "Card Series": "AMD Instinct MI250X",
            "Temperature (Sensor junction) (C)": "41.0",
        },
        "card1": {
            "Card Series": "AMD Instinct MI250X",
            "Temperature (Sensor junction) (C)": "97.0",
        },
        "system": {"Driver version": "6.3.6"},
    }
)


def test_local_host_passes_the_gate(local_inventory: Path) -> None:
    hosts = inventory.load(local_inventory).select()
    with Fleet(hosts) as fleet:
        report = health.run_checks(fleet)
    (host,) = report.hosts
    names = [c.name for c in host.checks]
    for name in ("reachable", "clock", "disk", "shared_fs", "memory", "load", "gpu", "rdzv_port"):
        assert name in names
    assert host.check("shared_fs").state == OK  # the controller's marker was seen
    assert host.check("gpu").detail.startswith("skipped")
    assert host.check("python_env").state == OK and host.env["torch"].startswith("2.")
    assert report.state in (OK, WARN)  # load may be high on a busy machine; never CRIT
    assert not list((local_inventory.parent / "shared" / ".rlmctl").iterdir())  # marker removed


def test_cli_health_json_exit_codes(local_inventory: Path) -> None:
    result = rlmctl("-i", str(local_inventory), "health", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["hosts"][0]["host"] == "localhost"
    with socket.socket() as busy:  # the rendezvous port taken: critical, exit 1
        busy.bind(("0.0.0.0", 29573))
        busy.listen()
        result = rlmctl("-i", str(local_inventory), "health", "--json")
    assert result.returncode == 1
    checks = json.loads(result.stdout)["hosts"][0]["checks"]
    port = next(c for c in checks if c["name"] == "rdzv_port")
    assert port["state"] == CRIT and "29573" in port["detail"] and "rlmctl stop" in port["fix"]


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


def test_nvidia_parser_and_verdicts() -> None:
    gpus = hostcheck.parse_nvidia_smi(NVIDIA_SMI)
    assert [g["index"] for g in gpus] == [0, 1, 2, 3] and gpus[0]["driver"] == "550.54.15"
    count = hostcheck.judge_gpus(gpus, 8, THRESHOLDS)
    assert count["state"] == CRIT and "4 GPUs visible" in count["detail"]
    ecc = hostcheck.judge_gpus(gpus, 4, THRESHOLDS)
    assert ecc["state"] == CRIT and "ECC" in ecc["detail"] and "[2]" in ecc["detail"]
    warm = hostcheck.judge_gpus([g | {"ecc_uncorrected": 0.0} for g in gpus], 4, THRESHOLDS)
    assert warm["state"] == WARN and "88 C" in warm["detail"]


def test_auto_vendor_without_gpu_tools_is_skipped(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, vendor="auto", gpus=8)
    assert hostcheck.detect_vendor() == "none"  # this machine has neither nvidia-smi nor rocm-smi
    assert hostcheck.check_gpu(cfg)["state"] == OK
    assert hostcheck.check_xid(cfg)["detail"].startswith("skipped")


def test_xid_verdicts() -> None:
    assert hostcheck.parse_xids(KERNEL_LOG) == [13, 79]
    assert hostcheck.judge_xids([13, 79])["state"] == CRIT
    assert hostcheck.judge_xids([13])["state"] == WARN
    assert hostcheck.judge_xids([])["state"] == OK


def test_rocm_parser() -> None:
    gpus = hostcheck.parse_rocm_smi(ROCM_SMI)
    assert len(gpus) == 2 and gpus[1]["temp"] == 97.0 and gpus[0]["driver"] == "6.3.6"
    assert hostcheck.judge_gpus(gpus, 2, THRESHOLDS)["state"] == CRIT  # 97 C


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

"""playbooks/verify.yml (read-only) against this machine with stand-in vendor tools: GPUs visible
at the pinned driver, all-reduce bus bandwidth gated on the largest row, torch importable in the
venv. Run in check mode as a second guard: its checks read with check_mode disabled."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.ansible.playbook_run import FAKE_VENDOR_BIN, run_playbook, write_inventory


def test_verify_gates_on_bus_bandwidth_and_gpu_count(tmp_path: Path) -> None:
    tests_dir = tmp_path / "comm-tests"
    (tests_dir / "build").mkdir(parents=True)
    (tests_dir / "build" / "all_reduce_perf").symlink_to(FAKE_VENDOR_BIN / "all_reduce_perf")
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_host": "127.0.0.1",
    }
    inventory = {
        "all": {
            "children": {
                "compute": {
                    "hosts": {
                        "nv_fast": {
                            **local,
                            "rlm_gpu_vendor": "nvidia",
                            "rlm_comm_busbw_floor_gbps": 400,
                        },
                        "nv_slow": {
                            **local,
                            "rlm_gpu_vendor": "nvidia",
                            "rlm_comm_busbw_floor_gbps": 500,
                        },
                        "amd_node": {
                            **local,
                            "rlm_gpu_vendor": "amd",
                            "rlm_comm_busbw_floor_gbps": 300,
                        },
                    }
                }
            },
            "vars": {
                "rlm_gpus_per_node": 8,
                "rlm_shared_fs": "none",
                # The venv this test runs in has torch and the bundle: the trainer check reads it.
                "rlm_venv": sys.prefix,
                "comm_tests_dir": str(tests_dir),
            },
        }
    }
    run = run_playbook(
        "verify.yml",
        write_inventory(tmp_path / "hosts.yml", inventory),
        tmp_path,
        check=True,
        env={
            "PATH": f"{FAKE_VENDOR_BIN}{os.pathsep}{os.environ['PATH']}",
            "FAKE_GPU_STATE_DIR": str(tmp_path / "gpu-state"),
        },
    )
    gate = "Check bus bandwidth against the floor"
    assert (
        "busbw 460.32 GB/s at 17179869184 B (floor 400" in run.task("nv_fast", gate).result["msg"]
    )
    slow = run.task("nv_slow", gate)
    assert slow.failed and "busbw 460.32 GB/s at 17179869184 B" in slow.result["msg"]
    assert "floor 500 GB/s" in slow.result["msg"]
    assert (
        "8 GPUs on driver 550.*"
        in run.task("nv_fast", "Check the expected GPUs and driver branch").result["msg"]
    )
    assert (
        "8 GPU agents: gfx942"
        in run.task("amd_node", "Check the expected number of GPUs is visible").result["msg"]
    )
    assert not run.task("amd_node", gate).failed
    trainer = run.task("nv_fast", "Check torch and the bundle versions").result["msg"]
    assert "torch 2.13.0" in trainer and "rlm-ops 0.1.0" in trainer
    assert [run.stats(h)["failures"] for h in ("nv_fast", "nv_slow", "amd_node")] == [0, 1, 0]

"""bench/gpu.py's CPU rehearsal: every GPU run's code path (strategy, precision, compile,
activation checkpointing, checkpoint format, async save, world size) trains on CPU at the tiny
width before a GPU slot is spent on it; the plan check, the figures and the fixture recording run
as they would there; one run that fails leaves the others' figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.training_runs import REPO, cli_env


def rehearse(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    result = subprocess.run(
        [sys.executable, "bench/gpu.py", "--rehearse", "--out", str(out), *extra],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    results = json.loads((out / "gpu-bench.json").read_text())
    return result, results


@pytest.mark.integration
def test_the_rehearsal_runs_every_gpu_run_and_one_failure_loses_nothing(tmp_path: Path) -> None:
    # The 1b run trains, then fails at its last save (no disk is that large): it keeps its
    # figures, the others run and keep theirs.
    override = "1b-mfu:checkpoint.min_free_bytes=1000000000000000"
    result, results = rehearse(tmp_path, "--override", override)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = results["runs"]
    assert set(runs) == {"1b-mfu", "3.5b-step", "3.5b-async-save", "1b-offload"}

    failed = runs["1b-mfu"]
    assert failed["status"] == "failed" and failed["exit_code"] != 0
    assert "checkpoint step-00000002 not saved" in failed["error"], failed
    assert "needs about" in failed["error"] and len(failed["errors"]) >= 2, failed
    assert failed["figures"]["steps"] == 2 and failed["figures"]["mfu"] > 0
    assert failed["code_path"] == {**failed["gpu_code_path"], "micro_batch": 2}
    assert failed["code_path"]["strategy"] == "fsdp" and not failed["code_path"]["offload"]

    run = runs["3.5b-async-save"]
    assert run["status"] == "ok", run.get("stderr_tail")
    # The rehearsal ran the GPU run's code path: the shipped config's layout (hsdp), bf16,
    # compiled, activation checkpointing, sharded async checkpoints, one rank.
    assert run["code_path"] == {**run["gpu_code_path"], "micro_batch": 2}, run
    assert run["gpu_code_path"]["strategy"] == "hsdp" and run["gpu_code_path"]["compile"]
    # The plan for one H200 says that layout fits, and by how much.
    check = run["memory_check"]
    assert check["fits"] and check["layout"] == "hsdp" and check["usable_gib"] > 100, check
    assert check["per_gpu_gib"] > 50, check  # 16 B/param of 3.56 B parameters: not the tiny width
    figures = run["figures"]
    assert figures["steps"] == 3 and figures["tokens_per_s"] > 0 and figures["mfu"] > 0
    assert figures["peak_memory_gib"] > 0 and figures["step_time_s"]["spread"] >= 1
    assert len(figures["checkpoint_save_s"]) == 2  # the interval save at 2, the final one at 3
    assert "PaLM" in figures["flop_convention"]
    same = runs["3.5b-step"]
    assert same["status"] == "skipped" and "rehearsed by 3.5b-async-save" in same["reason"]
    assert same["gpu_code_path"] == run["gpu_code_path"]

    offload = runs["1b-offload"]
    assert offload["status"] == "skipped" and "needs a GPU" in offload["reason"]
    # The tools are missing here: said so, nothing faked; the all-reduce log path runs (gloo).
    fixtures = results["fixtures"]
    assert fixtures["nvidia-smi-q.xml"] == "not recorded: nvidia-smi not found on this machine"
    log = Path(fixtures["nccl-allreduce-info.log"]).read_text()
    assert log.startswith("# recorded ") and "a rehearsal, not an NCCL fixture" in log
    assert "RLMCTL-ALLREDUCE" in log and '"correct": true' in log, log[-2000:]

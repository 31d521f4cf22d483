"""bench/gpu.py's CPU rehearsal: every GPU run's code path (strategy, precision, compile,
activation checkpointing, checkpoint format, async save, world size) trains on CPU at the tiny
width before a GPU slot is spent on it; the plan check, the figures and the fixture recording run
as they would there; one run that fails leaves the others' figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_the_rehearsal_runs_every_gpu_run_and_one_failure_loses_nothing(tmp_path: Path) -> None:
    # The 1b run is made to fail (a config error): the others must run and keep their figures.
    result, results = rehearse(tmp_path, "--override", "1b-mfu:model.n_heads=5")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = results["runs"]
    assert list(runs) == ["1b-mfu", "3.5b-step", "3.5b-async-save", "1b-offload"]

    failed = runs["1b-mfu"]
    assert failed["status"] == "failed" and failed["exit_code"] != 0
    assert "model.n_heads=5 must divide" in failed["error"], failed

    for name in ("3.5b-step", "3.5b-async-save"):
        run = runs[name]
        assert run["status"] == "ok", run.get("stderr_tail")
        # The plan for one H200 picks the layout the GPU run will use, and it fits.
        check = run["memory_check"]
        assert check["fits"] and check["layout"] == "ddp" and check["usable_gib"] > 100, check
        # The GPU run's path, at the tiny width: only width, depth, steps and device differ.
        expected = ["parallel.strategy=ddp", "train.precision=bf16", "model.compile=true"]
        expected += ["model.activation_checkpointing=true", "checkpoint.format=sharded"]
        expected += ["checkpoint.async_save=true", "model.preset=huginn-3.5b"]
        assert set(expected) <= set(run["overrides"]), run["overrides"]
        figures = run["figures"]
        assert figures["steps"] >= 2 and figures["tokens_per_s"] > 0 and figures["mfu"] > 0
        assert figures["peak_memory_gib"] > 0 and figures["step_time_s"]["spread"] >= 1
        assert "PaLM" in figures["flop_convention"]
    assert len(runs["3.5b-async-save"]["figures"]["checkpoint_save_s"]) == 2  # steps 2 and 3
    assert len(runs["3.5b-step"]["figures"]["checkpoint_save_s"]) == 1  # the final save only

    offload = runs["1b-offload"]
    assert offload["status"] == "skipped" and "needs a GPU" in offload["reason"]
    # The tools are missing here: said so, nothing faked; the all-reduce log path runs (gloo).
    fixtures = results["fixtures"]
    assert fixtures["nvidia-smi-q.xml"] == "not recorded: nvidia-smi not found on this machine"
    log = Path(fixtures["nccl-allreduce-info.log"]).read_text()
    assert log.startswith("# recorded ") and "a rehearsal, not an NCCL fixture" in log
    assert "RLMCTL-ALLREDUCE" in log and '"correct": true' in log, log[-2000:]

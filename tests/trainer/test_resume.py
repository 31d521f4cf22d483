"""Resume through real `python -m trainer train` processes: exact, after SIGTERM, and elastic.

The uninterrupted reference and the 1-rank continuation run in-process (one Python start less
each, the slowest part of these tests); torch uses one thread there, as in the subprocesses.
"""

from __future__ import annotations

import math
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.faults import Faults, faults_env
from tests.trainer.training_runs import (
    TINY,
    overrides,
    run_cli,
    start_training,
    tiny_config,
    torchrun,
)
from trainer.rundir import ExitCode, RunDir, read_jsonl
from trainer.train import train as train_in_process

STEPS = 4
GLOBAL_BATCH = 8
# A constant learning rate after warmup: the 2-rank run stopped by train.steps=2 follows the same
# schedule as the reference configured for STEPS from the start.
SAME_SCHEDULE = ["optim.warmup_steps=2", "optim.min_lr_ratio=1.0", "checkpoint.interval_steps=100"]
# Every process of these runs appends the sample positions it trains on to a ledger.
LEDGER = faults_env(ledger=True)


def train(data: Path, run_dir: Path, steps: int, *extra: str) -> subprocess.CompletedProcess[str]:
    args = overrides(data, run_dir, f"train.steps={steps}", *SAME_SCHEDULE, *extra)
    result = run_cli("train", "--config", str(TINY), *args, timeout=300, env=LEDGER)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def train_here(data: Path, run_dir: Path, steps: int) -> None:
    """`train` in this process, with one intra-op thread like the subprocesses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = tiny_config(data, run_dir, f"train.steps={steps}", *SAME_SCHEDULE)
        assert train_in_process(cfg, hooks=Faults(ledger=True)) == ExitCode.OK
    finally:
        torch.set_num_threads(threads)


def losses(run_dir: Path) -> dict[int, tuple[Any, Any]]:
    """(loss, grad_norm) of every step in metrics.jsonl; a step logged twice would be a bug."""
    records = [r for r in RunDir(run_dir).read_metrics() if r.get("kind") == "train"]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}


def ledger_positions(run_dir: Path) -> dict[int, list[int]]:
    """Global sample positions trained on at each step, over every rank and every restart."""
    by_step: dict[int, list[int]] = {}
    for path in sorted(run_dir.glob("ledger-rank*.jsonl")):
        for record in read_jsonl(path):
            by_step.setdefault(record["step"], []).extend(record["positions"])
    return by_step


def assert_no_repeats_no_gaps(run_dir: Path) -> None:
    by_step = ledger_positions(run_dir)
    assert sorted(by_step) == list(range(STEPS))
    for step, positions in by_step.items():
        expected = list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
        assert sorted(positions) == expected, f"step {step}: {sorted(positions)}"


@pytest.fixture(scope="module")
def reference(prepared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """Per-step losses of an uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    train_here(prepared_data, run_dir, STEPS)
    assert_no_repeats_no_gaps(run_dir)
    return losses(run_dir)


@pytest.mark.integration
def test_sigterm_saves_and_resume_continues_bit_for_bit(
    prepared_data: Path, tmp_path: Path, reference: dict[int, Any]
) -> None:
    run_dir = tmp_path / "run"
    args = overrides(prepared_data, run_dir, f"train.steps={STEPS}", *SAME_SCHEDULE)
    proc = start_training(*args, env=LEDGER)
    try:
        deadline = time.monotonic() + 240
        while not losses(run_dir) and time.monotonic() < deadline:  # the first step is done
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    run = RunDir(run_dir)
    assert run.read_status()["state"] == "stopped"
    stopped_at = run.read_status()["step"]
    assert 1 <= stopped_at < STEPS, "the run finished before SIGTERM arrived; raise STEPS"
    assert [i.step for i in run.checkpoints() if i.valid] == [stopped_at]

    second = train(prepared_data, run_dir, STEPS)
    assert f"resumed at step {stopped_at}" in second.stderr
    assert losses(run_dir) == reference  # exact float equality at every step, before and after
    assert_no_repeats_no_gaps(run_dir)
    assert [e["event"] for e in run.read_events()].count("start") == 2


@pytest.mark.integration
def test_elastic_resume_from_two_ranks_to_one(
    prepared_data: Path, tmp_path: Path, reference: dict[int, Any]
) -> None:
    run_dir = tmp_path / "run"
    args = overrides(prepared_data, run_dir, "train.steps=2", *SAME_SCHEDULE)
    first = torchrun(2, "--config", str(TINY), *args, timeout=300, env=LEDGER)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "bus bandwidth" in first.stderr  # rank 0's startup all-reduce sweep
    assert sorted(p.name for p in run_dir.glob("ledger-rank*")) == [
        "ledger-rank0.jsonl",
        "ledger-rank1.jsonl",
    ]
    train_here(prepared_data, run_dir, STEPS)  # one process, same global batch
    assert_no_repeats_no_gaps(run_dir)
    # The same samples and per-sample noise: only the gradient reduction order differs.
    for step, (loss, grad_norm) in losses(run_dir).items():
        ref_loss, ref_norm = reference[step]
        assert math.isclose(loss, ref_loss, rel_tol=1e-4), (step, loss, ref_loss)
        assert math.isclose(grad_norm, ref_norm, rel_tol=1e-3), (step, grad_norm, ref_norm)

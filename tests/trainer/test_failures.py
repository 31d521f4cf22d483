"""Durability of the training loop: non-finite steps and rollback, a hung peer at startup, and a
SIGTERM that arrives before the first step."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.trainer.faults import Faults, faults_env
from tests.trainer.training_runs import (
    REPO,
    TINY,
    overrides,
    start_training,
    tiny_config,
    torchrun,
)
from trainer.config import CommConfig
from trainer.distributed import DistEnv, describe_peer_timeout
from trainer.rundir import ExitCode, RunDir, read_jsonl
from trainer.train import train

GLOBAL_BATCH = 8  # training_runs.FAST


def train_steps(run: RunDir) -> list[int]:
    return [r["step"] for r in run.read_metrics() if r["kind"] == "train"]


def events(run: RunDir, kind: str) -> list[dict]:
    return [e for e in run.read_events() if e["event"] == kind]


@pytest.mark.integration
def test_nonfinite_streak_rolls_back_and_skips_the_bad_data(
    prepared_data: Path, tmp_path: Path
) -> None:
    run = RunDir(tmp_path / "run")
    cfg = tiny_config(
        prepared_data,
        run.path,
        "train.steps=8",
        "checkpoint.interval_steps=2",
        "checkpoint.keep_last=0",
        "train.max_nonfinite=2",
    )
    # the data of steps 4 and 5 of an uninterrupted run is poisoned
    assert train(cfg, hooks=Faults(nan_steps=(4, 5), ledger=True)) == ExitCode.OK

    # Steps 4 and 5 are dropped; the streak's own checkpoint (step 4) is no rollback target.
    records = [r for r in run.read_metrics() if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]
    assert [r["loss"] for r in records[3:5]] == ["nan", "nan"]
    assert all(isinstance(r["loss"], float) and math.isfinite(r["loss"]) for r in records[5:])
    assert [e["step"] for e in events(run, "nonfinite")] == [4, 5]
    (rollback,) = events(run, "rollback")
    assert rollback["from_step"] == 5 and rollback["to_step"] == 2
    assert rollback["checkpoint"].endswith("step-00000002")
    assert rollback["skipped_samples"] == 3 * GLOBAL_BATCH  # steps 3-5 of the first attempt

    # The data cursor kept moving: every sample position trained on at most once, none skipped
    # over except in order.
    positions = [p for r in read_jsonl(run.path / "ledger-rank0.jsonl") for p in r["positions"]]
    assert positions == list(range(11 * GLOBAL_BATCH))

    # Optimizer and scheduler came back from step 2: the new step-4 checkpoint has seen 2 + 2
    # applied updates (5 without the reload) and 4 scheduler steps (7 without).
    new_four = torch.load(run.checkpoint_path(4) / "optimizer.pt", weights_only=True)
    assert {int(s["step"]) for s in new_four["state"].values()} == {4}
    rest = torch.load(run.checkpoint_path(4) / "trainer_state.pt", weights_only=False)
    assert rest["scheduler"]["last_epoch"] == 4
    assert [c.step for c in run.checkpoints() if c.valid] == [2, 4, 6, 8]
    aside = list(run.checkpoints_dir.glob(".rolled-back-step-00000004-*"))
    assert len(aside) == 1, "the abandoned step-4 checkpoint is kept aside for inspection"

    final = torch.load(run.checkpoint_path(8) / "trainer_state.pt", weights_only=False)
    assert final["progress"]["nonfinite_steps"] == 2
    status = run.read_status()
    assert status["state"] == "done" and status["exit_code"] == 0 and status["step"] == 8


@pytest.mark.integration
def test_two_ranks_roll_back_together(prepared_data: Path, tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    args = overrides(
        prepared_data,
        run.path,
        "train.steps=4",
        "checkpoint.interval_steps=1",
        "train.max_nonfinite=2",
    )
    faults = faults_env(nan_steps=(3, 4), ledger=True)
    result = torchrun(2, "--config", str(TINY), *args, timeout=180, env=faults)
    assert result.returncode == 0, result.stderr[-3000:]
    assert train_steps(run) == [1, 2, 3, 4, 3, 4]
    (rollback,) = events(run, "rollback")
    assert rollback["from_step"] == 4 and rollback["to_step"] == 2
    # Each rank moved its cursor past the poisoned batches: no position trained twice.
    for rank in (0, 1):
        ledger = list(read_jsonl(run.path / f"ledger-rank{rank}.jsonl"))
        assert [r["step"] for r in ledger] == [0, 1, 2, 3, 2, 3]
    positions = sorted(
        p
        for rank in (0, 1)
        for r in read_jsonl(run.path / f"ledger-rank{rank}.jsonl")
        for p in r["positions"]
    )
    assert positions == list(range(6 * GLOBAL_BATCH))
    assert run.read_status()["state"] == "done"
    assert [c.step for c in run.checkpoints() if c.valid][-1] == 4


@pytest.mark.parametrize(
    ("extra", "nan_steps", "nonfinite_steps", "rollbacks"),
    [
        (["train.on_nonfinite=stop"], (2, 3), [2, 3], 0),
        # One rollback (to step 1, data moves on to batch 4), then the streak comes back.
        (["train.max_rollbacks=1"], (2, 3, 4, 5), [2, 3, 2, 3], 1),
    ],
    ids=["on_nonfinite=stop", "rollback-budget-used-up"],
)
def test_nonfinite_streak_stops_with_exit_4(
    prepared_data: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    nan_steps: tuple[int, ...],
    nonfinite_steps: list[int],
    rollbacks: int,
) -> None:
    run = RunDir(tmp_path / "run")
    cfg = tiny_config(
        prepared_data,
        run.path,
        "train.steps=8",
        "checkpoint.interval_steps=1",
        "train.max_nonfinite=2",
        *extra,
    )
    assert train(cfg, hooks=Faults(nan_steps=nan_steps)) == ExitCode.NONFINITE
    status = run.read_status()
    assert status["exit_code"] == ExitCode.NONFINITE and status["state"] == "failed"
    assert [e["step"] for e in events(run, "nonfinite")] == nonfinite_steps
    assert len(events(run, "rollback")) == rollbacks
    assert events(run, "exit")[-1]["exit_code"] == 4
    # setup_logging replaces the root handlers (caplog's too): read the log from stderr.
    errors = [line for line in capsys.readouterr().err.splitlines() if "] error: " in line]
    assert len(errors) == 1 and "non-finite steps in a row" in errors[0]
    assert ("on_nonfinite=stop" in errors[0]) == (rollbacks == 0)
    assert all(c.valid for c in run.checkpoints())


@pytest.mark.integration
def test_a_peer_that_hangs_at_startup_fails_the_job_fast(
    prepared_data: Path, tmp_path: Path
) -> None:
    run = RunDir(tmp_path / "run")
    args = overrides(
        prepared_data,
        run.path,
        "train.steps=2",
        "comm.startup_timeout_s=3",
    )
    started = time.monotonic()
    result = torchrun(2, "--config", str(TINY), *args, timeout=120, env=faults_env(stall_rank=1))
    elapsed = time.monotonic() - started
    assert result.returncode != 0, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "rank 1 (" in errors[0] and "did not answer within" in errors[0]
    assert "comm.startup_timeout_s=3 s" in errors[0]
    # torchrun prints its own ChildFailedError traceback; the trainer prints none.
    assert f'File "{REPO / "trainer"}' not in result.stderr
    assert "exitcode  : 1 " in result.stderr  # rank 0's code; torchrun itself exits 1 anyway
    status = run.read_status()
    assert status["state"] == "failed" and status["exit_code"] == ExitCode.FAILED
    assert not run.read_metrics()
    assert elapsed < 90, f"{elapsed:.0f} s: the stalled peer was not detected fast"


@pytest.mark.integration
def test_sigterm_during_setup_exits_cleanly_before_the_first_step(
    prepared_data: Path, tmp_path: Path
) -> None:
    """SIGTERM while the trainer sets up (loads the checkpoint): exit 0, nothing trained or saved.

    The signal must arrive after the handler is installed (status.json says "starting") and
    before the loop begins (no new "start" event); a try that misses that window is repeated.
    """
    for _attempt in range(3):
        run = RunDir(tmp_path / f"run-{_attempt}")
        assert train(tiny_config(prepared_data, run.path, "train.steps=1")) == ExitCode.OK
        args = overrides(prepared_data, run.path, "train.steps=4")
        proc = start_training(*args)
        try:
            deadline = time.monotonic() + 120
            while run.read_status().get("state") != "starting":
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                assert time.monotonic() < deadline, "the trainer never reported starting"
                time.sleep(0.002)
            os.kill(proc.pid, signal.SIGSTOP)  # freeze it to see where it is
            in_setup = len(events(run, "start")) == 1
            proc.send_signal(signal.SIGTERM)
            os.kill(proc.pid, signal.SIGCONT)
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        if in_setup:
            break
    else:
        pytest.fail("SIGTERM never arrived during setup in 3 tries")

    assert proc.returncode == ExitCode.OK, stderr[-3000:]
    assert "stop requested during setup" in stderr
    status = run.read_status()
    assert status["state"] == "stopped" and status["exit_code"] == 0 and status["step"] == 1
    assert train_steps(run) == [1], "no step may run after the signal"
    assert [c.step for c in run.checkpoints()] == [1] and run.checkpoints()[0].valid
    assert events(run, "exit")[-1]["state"] == "stopped"


# What gloo 2.13 raises, recorded from real 2-rank runs with rank 1 (then rank 0) stalled.
RANK0_SEES = "[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 3000 ms"
RANK1_SEES = (
    "Rank 1 successfully reached monitoredBarrier, but received errors while waiting for "
    "send/recv from rank 0. Please check rank 0 logs for faulty rank.\n Original exception: \n"
    "[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 3000ms for send operation"
)


@pytest.mark.parametrize(
    ("rank", "text", "named"),
    [(0, RANK0_SEES, "rank 1 (n1), rank 3 (n3) did not"), (1, RANK1_SEES, "rank 0 (n0) did not")],
)
def test_peer_timeout_names_the_silent_ranks_and_hosts(rank: int, text: str, named: str) -> None:
    env = DistEnv(rank, 4, rank, torch.device("cpu"), "gloo", ("n0", "n1", "n2", "n3"))
    message = describe_peer_timeout(RuntimeError(text), env, CommConfig(startup_timeout_s=3))
    assert message.startswith(f"rank {rank} (n{rank}): {named} answer within")
    assert "comm.startup_timeout_s=3 s" in message and "\n" not in message

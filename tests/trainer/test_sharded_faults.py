"""Sharded (DCP) checkpoints under faults, with real torchrun gloo workers: damaged or unreadable
files at resume, a full disk on one rank during a sync or async save, and a second SIGTERM while
an async save is stuck. All ranks agree (fall back together, or fail the save together), one line
names the rank, its host and the file, status.json tells the truth, nothing earlier is damaged.

Faults come from the trainer's test hooks (tests/trainer/faults.py): an I/O error when one rank
opens a given file, ENOSPC when one rank opens its shard files for writing.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.trainer.faults import Faults, faults_env
from tests.trainer.training_runs import REPO, TINY, cli_env, overrides, tiny_config, torchrun
from trainer.rundir import ExitCode, RunDir, read_jsonl, verify_checkpoint
from trainer.train import train

HOST = socket.gethostname()
# Constant learning rate after 2 warmup steps: a run stopped at step N continues on the schedule
# of an uninterrupted one. Checkpoints every 2 steps, all kept.
SHARDED = ["checkpoint.format=sharded", "checkpoint.interval_steps=2", "checkpoint.keep_last=0"]
SHARDED += ["optim.warmup_steps=2", "optim.min_lr_ratio=1.0"]
FSDP = ["parallel.strategy=fsdp", *SHARDED]


def in_process(data: Path, run_dir: Path, *extra: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train(tiny_config(data, run_dir, *extra), hooks=Faults()) == ExitCode.OK
    finally:
        torch.set_num_threads(threads)


def trainer_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "[rank " in line or line.startswith("error:")]


def no_trainer_traceback(stderr: str) -> None:
    assert f'File "{REPO / "trainer"}' not in stderr, stderr[-4000:]
    assert "CheckpointException" not in stderr, stderr[-4000:]


@pytest.mark.integration
def test_damaged_or_unreadable_shards_make_every_rank_fall_back_together(
    prepared_data: Path, tmp_path: Path
) -> None:
    run = RunDir(tmp_path / "run")
    in_process(prepared_data, run.path, "train.steps=12", *SHARDED)
    assert [c.step for c in run.checkpoints() if c.valid] == [2, 4, 6, 8, 10, 12]
    shard = "dcp/__0_0.distcp"  # one process wrote them: both ranks read from its files
    (run.checkpoint_path(10) / "dcp/__0_1.distcp").unlink()  # missing
    truncated = run.checkpoint_path(8) / shard
    truncated.write_bytes(truncated.read_bytes()[:-100])
    garbage = run.checkpoint_path(6) / shard  # same size: passes checkpoint.verify=size
    garbage.write_bytes(os.urandom(garbage.stat().st_size))
    kept = [p for c in (2, 6, 8, 12) for p in run.checkpoint_path(c).rglob("*") if p.is_file()]
    before = {path: path.read_bytes() for path in kept}

    # Rank 1 alone cannot read step 12's manifest and step 4's shard file.
    faults = faults_env(
        ledger=True,
        read_error_rank=1,
        read_error_files=("step-00000012/manifest.json", f"step-00000004/{shard}"),
    )
    args = overrides(prepared_data, run.path, "train.steps=4", *FSDP)
    result = torchrun(2, "--config", str(TINY), *args, timeout=300, env=faults)
    assert result.returncode == 0, result.stderr[-4000:]
    no_trainer_traceback(result.stderr)
    assert "resumed at step 2" in result.stderr
    lines = trainer_lines(result.stderr)

    def one_line(*fragments: str) -> str:
        found = [line for line in lines if all(f in line for f in fragments)]
        assert len(found) == 1, (fragments, lines)
        return found[0]

    eio = "Input/output error"
    line = one_line(f"rank 1 ({HOST}) cannot read step-00000012/manifest.json", eio)
    assert "all ranks fall back to step-00000006" in line  # 10 and 8 fail verification
    one_line("skipping", "step-00000010", "dcp/__0_1.distcp is missing")
    one_line("skipping", "step-00000008", "dcp/__0_0.distcp has")
    # Garbage of the right size: every rank fails to unpickle it (both read that file).
    for rank in (0, 1):
        one_line(f"rank {rank} ({HOST}) cannot read step-00000006/{shard}")
    line = one_line(f"rank 1 ({HOST}) cannot read step-00000004/{shard}", eio)
    assert "all ranks fall back to step-00000002" in line

    # Both ranks trained steps 3 and 4 from step 2, on the same global batches.
    for rank in (0, 1):
        assert [r["step"] for r in read_jsonl(run.path / f"ledger-rank{rank}.jsonl")] == [2, 3]
    status = run.status()
    assert status.state.value == "done" and status.exit_code == 0 and status.step == 4
    # Nothing earlier was touched; step 4, skipped because rank 1 could not read it, was set
    # aside (kept) and written anew by this run, so the next resume does not fall back again.
    assert all(path.read_bytes() == data for path, data in before.items())
    assert verify_checkpoint(run.checkpoint_path(4), full=True).valid
    assert len(list(run.checkpoints_dir.glob(".invalid-step-00000004-*"))) == 1


@pytest.mark.integration
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_and_says_so(
    prepared_data: Path, tmp_path: Path, async_save: bool
) -> None:
    """ENOSPC on rank 1 at steps 2 and 6 (the last): the step-2 save fails on every rank with
    one line naming rank 1, its host and the file, training goes on, step 4 saves, and the run
    whose last checkpoint failed ends failed with exit 1 (restartable), not done."""
    run = RunDir(tmp_path / "run")
    args = overrides(
        prepared_data,
        run.path,
        "train.steps=6",
        f"checkpoint.async_save={str(async_save).lower()}",
        *FSDP,
    )
    faults = faults_env(write_error_rank=1, write_error_steps=(2, 6))
    result = torchrun(2, "--config", str(TINY), *args, timeout=300, env=faults)
    no_trainer_traceback(result.stderr)
    assert result.returncode != 0
    lines = trainer_lines(result.stderr)
    for step in (2, 6):
        (line,) = [x for x in lines if f"checkpoint step-0000000{step} not saved" in x]
        assert f"rank 1 ({HOST})" in line and "No space left on device" in line, line
        assert f"step-0000000{step}" in line and "__1_" in line and ".distcp" in line, line
    events = [(e.kind, e.fields.get("step")) for e in run.events()]
    assert [e for e in events if e[0].startswith("checkpoint")] == [
        ("checkpoint_failed", 2),
        ("checkpoint", 4),
        ("checkpoint_failed", 6),
    ]
    status = run.status()
    assert status.state.value == "failed" and status.exit_code == ExitCode.FAILED
    assert status.step == 6
    assert [c.step for c in run.checkpoints()] == [4]
    assert verify_checkpoint(run.checkpoint_path(4), full=True).valid
    assert not [p.name for p in run.checkpoints_dir.iterdir() if p.name.startswith(".tmp-")]


def wait_for_line(stream, text: str, timeout: float) -> str:
    """Read `stream` (a pipe) until a line containing `text` arrives; what was read."""
    selector = selectors.DefaultSelector()
    selector.register(stream, selectors.EVENT_READ)
    seen, deadline = "", time.monotonic() + timeout
    while text not in seen:
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{seen[-3000:]}"
        if selector.select(timeout=1):
            line = stream.readline()
            assert line, f"the process ended before {text!r}:\n{seen[-3000:]}"
            seen += line
    return seen


def test_a_second_sigterm_during_a_stuck_async_save_leaves_a_true_status(
    prepared_data: Path, tmp_path: Path
) -> None:
    """The first SIGTERM asks for a stop after the step; the save of step 1 hangs (a stuck
    filesystem), so the stop waits for it; the second SIGTERM exits 1 at once. status.json must
    then say failed with exit code 1 (it said running), with an exit event."""
    run = RunDir(tmp_path / "run")
    marker = tmp_path / "stalled"
    faults = faults_env(stall_phase="shards-written:1", stall_marker=str(marker))
    args = overrides(
        prepared_data,
        run.path,
        "train.steps=3",
        "checkpoint.interval_steps=1",
        "checkpoint.async_save=true",
        *SHARDED[:1],
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", "train", "--config", str(TINY), *args],
        cwd=REPO,
        env=cli_env(faults),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():  # the hook writes it when the save thread hangs
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the save never reached the stalled phase"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        wait_for_line(proc.stderr, "SIGTERM: stopping after this step", 60)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == ExitCode.FAILED, rest[-3000:]
    assert "SIGTERM again: exiting without a checkpoint" in rest
    status = run.status()
    assert status.state.value == "failed" and status.exit_code == ExitCode.FAILED
    exits = [e for e in run.events() if e.kind == "exit"]
    assert [(e.fields["exit_code"], e.fields["state"]) for e in exits] == [(1, "failed")]
    assert [c.step for c in run.checkpoints()] == []  # the stuck save never published step 1

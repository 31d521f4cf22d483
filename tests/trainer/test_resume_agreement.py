"""All ranks resume from one checkpoint: chosen once, read-checked on every rank, fallen back from
together (real torchrun processes over gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.faults import Faults, faults_env
from tests.trainer.training_runs import TINY, overrides, tiny_config, torchrun
from trainer.rundir import ExitCode, RunDir, read_jsonl
from trainer.train import train

GLOBAL_BATCH = 8  # training_runs.FAST
KEEP_SCHEDULE = ["optim.warmup_steps=2", "optim.min_lr_ratio=1.0", "checkpoint.keep_last=0"]


def ledger_steps(run_dir: Path, rank: int) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir / f"ledger-rank{rank}.jsonl")]


@pytest.mark.integration
def test_read_error_on_rank_1_makes_both_ranks_fall_back_together(
    prepared_data: Path, tmp_path: Path
) -> None:
    run = RunDir(tmp_path / "run")
    # Checkpoints at steps 2 and 4, written by one process (resume is elastic).
    first = tiny_config(
        prepared_data, run.path, "train.steps=4", "checkpoint.interval_steps=2", *KEEP_SCHEDULE
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train(first, hooks=Faults(ledger=True)) == ExitCode.OK
    finally:
        torch.set_num_threads(threads)
    assert [c.step for c in run.checkpoints() if c.valid] == [2, 4]
    (run.path / "ledger-rank0.jsonl").unlink()

    # Rank 1 cannot read the newest checkpoint's model.pt; rank 0 can.
    args = overrides(
        prepared_data, run.path, "train.steps=6", "checkpoint.interval_steps=2", *KEEP_SCHEDULE
    )
    faults = faults_env(
        ledger=True, read_error_rank=1, read_error_files=("step-00000004/model.pt",)
    )
    result = torchrun(2, "--config", str(TINY), *args, timeout=300, env=faults)
    assert result.returncode == 0, result.stderr[-3000:]
    # Both ranks trained steps 2..5 (0-based): the same step, the same global batches.
    assert ledger_steps(run.path, 0) == ledger_steps(run.path, 1) == [2, 3, 4, 5]
    positions = sorted(
        p
        for rank in (0, 1)
        for r in read_jsonl(run.path / f"ledger-rank{rank}.jsonl")
        for p in r["positions"]
    )
    assert positions == list(range(2 * GLOBAL_BATCH, 6 * GLOBAL_BATCH))
    # One line names the rank, the file and why, and where all ranks went instead.
    (line,) = [x for x in result.stderr.splitlines() if "cannot read" in x]
    assert "rank 1" in line and "step-00000004/model.pt" in line, line
    assert "Input/output error" in line and "step-00000002" in line, line
    assert "resumed at step 2" in result.stderr
    assert [c.step for c in run.checkpoints() if c.valid] == [2, 4, 6]  # nothing deleted

"""Depth per micro-batch (lockstep across ranks) and train.deterministic."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.trainer.training_runs import tiny_config
from trainer.rundir import ExitCode, RunDir
from trainer.train import recurrence_depths, train


@pytest.fixture
def restore_determinism() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def test_depth_per_step_or_per_micro_batch(prepared_data: Path, tmp_path: Path) -> None:
    per_step = tiny_config(prepared_data, tmp_path, "model.mean_recurrence=8")
    per_micro = tiny_config(
        prepared_data, tmp_path, "model.mean_recurrence=8", "train.depth_per=micro_batch"
    )
    for step in range(5):
        assert len(set(recurrence_depths(per_step, step, 4))) == 1
        # A function of (seed, step, micro-batch index) only: every rank computes the same list,
        # and a resumed run the same again.
        assert recurrence_depths(per_micro, step, 4) == recurrence_depths(per_micro, step, 4)
    draws = [recurrence_depths(per_micro, step, 4) for step in range(5)]
    assert any(len(set(d)) > 1 for d in draws), draws


@pytest.mark.integration
def test_a_run_with_depth_per_micro_batch_and_deterministic_kernels(
    prepared_data: Path, tmp_path: Path, restore_determinism: None
) -> None:
    extra = ("train.steps=2", "train.depth_per=micro_batch", "train.deterministic=true")
    losses = []
    for name in ("a", "b"):
        torch.use_deterministic_algorithms(False)
        assert train(tiny_config(prepared_data, tmp_path / name, *extra)) == ExitCode.OK
        assert torch.are_deterministic_algorithms_enabled()
        records = [r for r in RunDir(tmp_path / name).read_metrics() if r["kind"] == "train"]
        losses.append([(r["loss"], r["grad_norm"]) for r in records])
    assert losses[0] == losses[1]  # bit for bit

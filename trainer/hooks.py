"""Test seams of the training loop: the points where a test injects faults. Production uses the
no-op `TrainHooks`.

The failure and resume tests need a rank that hangs at startup, NaN losses on chosen batches, a
checkpoint that one rank cannot read and a ledger of the sample positions each rank trained on. None of that belongs in a production
config; the tests implement it in tests/trainer/faults.py and pass it to `train(cfg, hooks=...)`,
or, for a subprocess, name a factory in the environment: `RLM_TRAINER_HOOKS=module:function`.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch

from trainer.distributed import DistEnv

HOOKS_ENV = "RLM_TRAINER_HOOKS"


class TrainHooks:
    """Called at fixed points of a run; every method does nothing here."""

    def before_startup_check(self, env: DistEnv) -> None:
        """Before the ranks first talk to each other."""

    def on_batch(
        self, run_dir: Path, rank: int, step: int, positions: list[int], indices: list[int]
    ) -> None:
        """Before step `step` (0-based) trains on these global positions / dataset indices."""

    def on_checkpoint_read(self, rank: int, path: Path) -> None:
        """Before this rank reads checkpoint file `path` at resume or rollback (may raise OSError)."""

    def on_checkpoint_write(self, rank: int, path: Path) -> None:
        """Before this rank opens shard file `path` of a sharded save for writing (may raise
        OSError)."""

    def on_checkpoint_phase(self, rank: int, phase: str) -> None:
        """At each phase of a checkpoint save on this rank (`CheckpointStore.phase_hook`)."""

    def loss(self, loss: torch.Tensor, cursor: int, global_batch: int) -> torch.Tensor:
        """The micro-batch loss about to be backpropagated; `cursor` is the step's first global
        sample position."""
        return loss


def hooks_from_env() -> TrainHooks:
    """The hooks named by RLM_TRAINER_HOOKS (a zero-argument factory), else the no-op ones."""
    spec = os.environ.get(HOOKS_ENV)
    if not spec:
        return TrainHooks()
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)()

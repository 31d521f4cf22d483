"""The stateful components of a training run: what a checkpoint holds, each entry with one owner.

No RNG state is saved: nothing a step computes draws from a global generator (the depth is
seeded from the step, the latent-state noise from each sample's global position, the data order
from the position), so a resume is exact without one; tests/trainer/test_resume.py proves it
bit for bit.

Every component has `state_dict()` / `load_state_dict()` (torchtitan's `Stateful`). A checkpoint
is one dict; a component's `state_dict()` returns the top-level entries it owns, and components
that share an entry (`progress`) own disjoint fields of it. The checkpoint manager
(`trainer.checkpoint.CheckpointManager`) merges them on save and hands the whole dict back to
each on load, so the on-disk format (docs/checkpoints.md) is written in one place per field:

    TrainState   model, optimizer, scheduler, scaler      rolled back after a non-finite streak
    Progress     progress.step, progress.tokens           rolled back
    DataCursor   progress.sample_index, epoch, data_fingerprint, consumed_shards
    StepHealth   progress.nonfinite_steps, skipped_steps
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from trainer import mapped_state, parallel, sharded_checkpoint
from trainer.data import GlobalSampler, TokenDataset, consumed_shards, rank_positions
from trainer.distributed import DistEnv
from trainer.errors import ConfigError

log = logging.getLogger("trainer")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Progress:
    """Optimizer steps done and tokens trained on."""

    step: int = 0
    tokens: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"progress": {"step": self.step, "tokens": self.tokens}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["progress"]["step"]
        self.tokens = state["progress"]["tokens"]


@dataclass
class StepHealth:
    """Counters of dropped and skipped steps. Only the totals are saved: a streak and the
    rollback budget belong to this process."""

    nonfinite_steps: int = 0  # steps dropped for a non-finite loss or gradient norm
    skipped_steps: int = 0  # fp16 steps the loss scaler skipped
    nonfinite_in_a_row: int = 0
    rollbacks: int = 0  # by this process; train.max_rollbacks is the budget

    def record(self, finite: bool) -> None:
        if finite:
            self.nonfinite_in_a_row = 0
        else:
            self.nonfinite_steps += 1
            self.nonfinite_in_a_row += 1

    def state_dict(self) -> dict[str, Any]:
        fields = {"nonfinite_steps": self.nonfinite_steps, "skipped_steps": self.skipped_steps}
        return {"progress": fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.nonfinite_steps = state["progress"].get("nonfinite_steps", 0)
        self.skipped_steps = state["progress"].get("skipped_steps", 0)


class DataCursor:
    """The global sample position of the next step over a fixed, seeded order of the data.

    It only moves forward: a rollback does not restore it, so the data that led into a non-finite
    streak is not replayed.
    """

    def __init__(self, dataset: TokenDataset, seed: int, env: DistEnv) -> None:
        self.dataset = dataset
        self.sampler = GlobalSampler(len(dataset), seed)
        self.env = env
        self.position = 0

    def batch(self, global_batch: int) -> tuple[list[int], list[int]]:
        """(global positions, dataset indices) of this rank's share of the next step."""
        positions = rank_positions(self.position, global_batch, self.env.rank, self.env.world_size)
        return positions, self.sampler.indices(positions)

    def advance(self, global_batch: int) -> None:
        self.position += global_batch

    def state_dict(self) -> dict[str, Any]:
        # Only rank 0's copy is saved.
        main = self.env.is_main
        shards = consumed_shards(self.dataset, self.sampler, self.position) if main else []
        fields = {
            "sample_index": self.position,
            "epoch": self.sampler.epoch(self.position),
            "data_fingerprint": self.dataset.fingerprint,
            "consumed_shards": shards,
        }
        return {"progress": fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["progress"]
        self.position = saved["sample_index"]
        # No fingerprint: a checkpoint imported from published weights, which saw no data here.
        if saved.get("data_fingerprint") not in (None, self.dataset.fingerprint):
            log.warning(
                "resuming on different data (fingerprint %s, checkpoint has %s): the data order "
                "continues at sample %d of the new dataset",
                self.dataset.fingerprint,
                saved.get("data_fingerprint"),
                self.position,
            )


class TrainState:
    """Model, optimizer, LR scheduler and (fp16) grad scaler: the tensors of a run."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler | None,
        sharded_checkpoints: bool = False,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.scaler = (
            model,
            optimizer,
            scheduler,
            scaler,
        )
        self.sharded_checkpoints = sharded_checkpoints  # checkpoint.format=sharded (DCP)

    def tensor_template(self) -> dict[str, Any]:
        """Model and optimizer state as DCP reads it into this rank's shards."""
        return sharded_checkpoint.tensor_state(self.model, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        if self.sharded_checkpoints:  # each rank's own shards, written by each rank
            shards = self.tensor_template()
            model, optimizer = shards["model"], shards["optimizer"]
        elif parallel.is_sharded(self.model):  # gathered into the unsharded layout (a collective)
            model, optimizer = parallel.full_state(self.model, self.optimizer)
        else:
            model, optimizer = self.model.state_dict(), self.optimizer.state_dict()
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            if state.get(sharded_checkpoint.FORMAT_KEY) == "sharded":
                sharded_checkpoint.apply_tensor_state(self.model, self.optimizer, state)
            elif parallel.is_sharded(self.model):
                parallel.load_full_state(
                    self.model, self.optimizer, state["model"], state["optimizer"]
                )
            else:
                # A full checkpoint is memory-mapped (trainer/mapped_state.py): the copies made
                # here are this rank's, the file's pages are let go once copied.
                self.model.load_state_dict(state["model"])
                mapped_state.release(state["model"])
                if state["optimizer"]:  # empty in an imported checkpoint: start the optimizer fresh
                    self.optimizer.load_state_dict(mapped_state.copied(state["optimizer"]))
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ConfigError(
                f"the checkpoint does not fit this model/optimizer config ({misfit(exc)}); "
                "use the config it was trained with, or checkpoint.resume=never"
            ) from None
        if state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


_SIZE_MISMATCH = re.compile(
    r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
    r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)"
)


def misfit(exc: BaseException) -> str:
    """The first tensor that does not fit, with both shapes (else the first line that says what
    is missing or unexpected): torch's own message starts with a line naming no tensor."""
    text = str(exc)
    match = _SIZE_MISMATCH.search(text)
    if match:
        name, saved, wanted = match.groups()
        return f"tensor {name} is {saved} in the checkpoint, {wanted} in this model"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    keyed = [line for line in lines if "key" in line.lower()]
    return (keyed or lines or [type(exc).__name__])[0][:200]

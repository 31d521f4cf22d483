"""Sharded checkpoints through `torch.distributed.checkpoint` (DCP): every rank writes its shards.

With `checkpoint.format=sharded` a checkpoint directory holds

    dcp/.metadata            DCP's index of every tensor shard (written by rank 0)
    dcp/__<rank>_<n>.distcp  the tensor data each rank wrote: model and optimizer state
    trainer_state.pt         scheduler, grad scaler, progress, RNG states, config (rank 0)
    manifest.json            size + sha256 of every file above, written last by rank 0

The protocol is the one of full checkpoints (trainer/checkpoint.py): rank 0 creates the hidden
temp directory and broadcasts its name; every rank writes its DCP shards into it and hashes the
files it wrote; rank 0 gathers the digests, writes trainer_state.pt and the manifest, fsyncs and
renames the directory into place. A crash at any point leaves a hidden temp directory, never a
`step-*` name on incomplete data.

Async (`checkpoint.async_save=true`): `dcp.async_save` copies the state to host memory and
returns; its writes, the digests and the rename run in one background thread per rank, on a gloo
process group of their own (collectives from a second thread must not interleave with the
training loop's on the default group).

Resume reads with `dcp.load` into the state dict of the model as it is now sharded, so each rank
reads only the byte ranges of its own shards, whatever world size and strategy wrote them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

DCP_DIR = "dcp"
FORMAT_KEY = "checkpoint_format"  # set to "sharded" on a state read from a sharded checkpoint


def is_sharded(path: Path) -> bool:
    return (path / DCP_DIR).is_dir()


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model and optimizer state as DCP saves and loads it: by parameter name, each rank
    holding its own shards (plain tensors for an unsharded model)."""
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }


def apply_tensor_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def write_shards(tensors: dict[str, Any], tmp: Path, group: Any, async_save: bool) -> Any:
    """Start this rank's DCP write into `tmp/dcp`; a future with async_save, else None."""
    target = tmp / DCP_DIR
    if async_save:
        return dcp.async_save(tensors, checkpoint_id=str(target), process_group=group)
    dcp.save(tensors, checkpoint_id=str(target), process_group=group)
    return None


def digests_of_rank(tmp: Path, rank: int) -> dict[str, str]:
    """sha256 of the DCP files this rank wrote (rank 0 also owns .metadata), by manifest name."""
    names = sorted((tmp / DCP_DIR).glob(f"__{rank}_*.distcp"))
    if rank == 0:
        names.append(tmp / DCP_DIR / ".metadata")
    out = {}
    for path in names:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
            os.fsync(f.fileno())
        out[path.relative_to(tmp).as_posix()] = digest.hexdigest()
    return out


def read_shards(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    """Fill `template` (from `tensor_state`) from the checkpoint at `path`; each rank reads the
    parts of the files its own shards need."""
    group = None if not dist.is_initialized() else dist.group.WORLD
    dcp.load(template, checkpoint_id=str(path / DCP_DIR), process_group=group)
    return template

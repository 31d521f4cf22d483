"""Checkpoints to and from the published Hugging Face layout.

`export` writes a checkpoint in the layout of the published Huginn model (trainer/hf.py):
config.json with RavenConfig's field names, model.safetensors (sharded with an index above 5 GiB)
with its parameter names, and tokenizer.json when the run's dataset still has it. `import-hf`
reads that layout into a trainer checkpoint (step 0, weights only) that `train` continues from
and `generate` samples from.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import torch

import trainer
from trainer import sharded_checkpoint
from trainer.checkpoint import MODEL_FILE, TRAINER_STATE_FILE, CheckpointConfig, CheckpointStore
from trainer.errors import UserError
from trainer.hf import is_hf_dir, load_hf, save_hf
from trainer.model import ModelConfig, RecurrentLM
from trainer.rundir import MANIFEST_NAME, RunDir, verify_checkpoint

TOKENIZER_NAME = "tokenizer.json"


def _model_config(values: dict[str, Any], source: Path) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        return ModelConfig(**{k: v for k, v in values.items() if k in names})
    except TypeError as exc:
        raise UserError(f"{source} has an incomplete model config ({exc})") from None


def _read_checkpoint(checkpoint_dir: Path) -> tuple[RecurrentLM, dict[str, Any]]:
    """The model of a verified checkpoint and the run config saved with it."""
    info = verify_checkpoint(checkpoint_dir, full=True)
    if not info.valid:
        raise UserError(
            f"{checkpoint_dir} is not a usable checkpoint: {info.reason}; "
            "list valid ones with `python -m trainer checkpoints RUN_DIR`"
        )
    # trainer_state.pt is our own file and holds numpy RNG states the weights-only loader rejects.
    extra = torch.load(checkpoint_dir / TRAINER_STATE_FILE, map_location="cpu", weights_only=False)
    config = extra.get("config") or {}
    if not isinstance(config.get("model"), dict):
        raise UserError(f"{checkpoint_dir} records no model config; it cannot be exported")
    model = RecurrentLM(_model_config(config["model"], checkpoint_dir))
    if sharded_checkpoint.is_sharded(checkpoint_dir):
        sharded_checkpoint.read_model_weights(checkpoint_dir, model)
    else:
        weights = torch.load(checkpoint_dir / MODEL_FILE, map_location="cpu", weights_only=True)
        model.load_state_dict(weights)
    return model.eval(), {"config": config, "step": info.step}


def _checkpoint_tokenizer(config: dict[str, Any]) -> Path | None:
    """The tokenizer an imported checkpoint came with, or its dataset's."""
    candidates = [config.get("tokenizer")]
    data_path = (config.get("data") or {}).get("path")
    if data_path:
        candidates.append(str(Path(data_path) / TOKENIZER_NAME))
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def checkpoint_data_path(path: Path) -> Path | None:
    """The dataset a checkpoint's run trained on (None for exports and imports)."""
    if not (path / MANIFEST_NAME).exists():
        return None
    extra = torch.load(path / TRAINER_STATE_FILE, map_location="cpu", weights_only=False)
    data_path = ((extra.get("config") or {}).get("data") or {}).get("path")
    return Path(data_path) if data_path else None


def _fresh_dir(out_dir: Path) -> Path:
    """A hidden sibling to write into before renaming it to `out_dir`."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"{out_dir} already exists and is not empty; choose a new directory")
    tmp = out_dir.with_name(f".tmp-{out_dir.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def export_checkpoint(
    checkpoint_dir: Path | str, out_dir: Path | str, max_shard_bytes: int = 5 << 30
) -> Path:
    """Write a checkpoint into `out_dir` in the published Hugging Face layout.

    The directory appears complete or not at all: it is written under a temporary name first.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    model, saved = _read_checkpoint(checkpoint_dir)
    tmp = _fresh_dir(out_dir)
    try:
        save_hf(model, tmp, max_shard_bytes=max_shard_bytes)
        tokenizer = _checkpoint_tokenizer(saved["config"])
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER_NAME)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def load_exported(out_dir: Path | str) -> RecurrentLM:
    """The RecurrentLM of a directory in the published layout, on CPU, in eval mode."""
    return load_hf(Path(out_dir))


def import_hf(hf_dir: Path | str, run_dir: Path | str) -> Path:
    """A trainer checkpoint (step 0) in `run_dir` from a directory in the published layout.

    It holds the weights only: a `train` that resumes from it starts its optimizer state and
    schedule fresh. The tokenizer.json next to the weights is copied into the run directory.
    """
    hf_dir, run = Path(hf_dir), RunDir(run_dir)
    if not is_hf_dir(hf_dir):
        raise UserError(
            f"{hf_dir} has no config.json with model.safetensors or model.safetensors.index.json"
        )
    if run.checkpoints():
        raise UserError(f"{run.path} already has checkpoints; import into a new run directory")
    model = load_hf(hf_dir)
    run.create()
    config: dict[str, Any] = {"model": dataclasses.asdict(model.cfg), "imported_from": str(hf_dir)}
    if (hf_dir / TOKENIZER_NAME).is_file():
        shutil.copyfile(hf_dir / TOKENIZER_NAME, run.path / TOKENIZER_NAME)
        config["tokenizer"] = str((run.path / TOKENIZER_NAME).resolve())
    state = {
        "model": model.state_dict(),
        "optimizer": {},  # no optimizer state: training starts it fresh
        "scheduler": None,
        "scaler": None,
        "progress": {"step": 0, "tokens": 0, "sample_index": 0, "epoch": 0},
        "rng": [],
        "config": config,
        "version": trainer.__version__,
    }
    store = CheckpointStore(run, CheckpointConfig(verify="full"), 0, 1)
    if not store.save(0, state):
        raise UserError(f"could not write the checkpoint into {run.checkpoints_dir}")
    return run.checkpoint_path(0)


def load_any(path: Path) -> tuple[RecurrentLM, Path | None]:
    """A model from a checkpoint or an export directory, with the tokenizer that belongs to it."""
    if (path / MANIFEST_NAME).exists():
        model, saved = _read_checkpoint(path)
        return model, _checkpoint_tokenizer(saved["config"])
    if is_hf_dir(path):
        tokenizer = path / TOKENIZER_NAME
        return load_hf(path), tokenizer if tokenizer.is_file() else None
    raise UserError(
        f"{path} is neither a checkpoint (manifest.json) nor an export (config.json + "
        "model.safetensors)"
    )

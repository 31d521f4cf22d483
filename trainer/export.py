"""Checkpoints to and from the published Hugging Face layout.

`export` writes a checkpoint in the layout of the published Huginn model (trainer/hf.py):
config.json with RavenConfig's field names and an `auto_map` to the modelling code it ships
(trainer/hub/), model.safetensors (sharded with an index above 5 GiB) with the published
parameter names, and the tokenizer: tokenizer.json when the run's dataset (or the import it came
from) still has it, with tokenizer_config.json and generation_config.json carried from an import
or written for the trainer's tokenizer. `import-hf` reads that layout, or what transformers and
the published code write, into a trainer checkpoint (step 0, weights only, full or sharded) that
`train` continues from and `generate` samples from; the tokenizer files come along.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

import trainer
from trainer import sharded_checkpoint
from trainer.checkpoint import MODEL_FILE, TRAINER_STATE_FILE, CheckpointConfig, CheckpointStore
from trainer.errors import UserError
from trainer.hf import (
    GENERATION_CONFIG_NAME,
    TOKENIZER_CONFIG_NAME,
    is_hf_dir,
    load_hf,
    save_hf,
    token_files,
)
from trainer.model import ModelConfig, RecurrentLM
from trainer.rundir import MANIFEST_NAME, RunDir, verify_checkpoint

TOKENIZER_NAME = "tokenizer.json"
# Files that travel with the weights through import-hf and export byte for byte, kept next to
# the tokenizer.json they belong to.
CARRIED_FILES = (
    TOKENIZER_NAME,
    TOKENIZER_CONFIG_NAME,
    "special_tokens_map.json",
    GENERATION_CONFIG_NAME,
)
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


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
    checkpoint_dir: Path | str,
    out_dir: Path | str,
    max_shard_bytes: int = 5 << 30,
    notes: list[str] | None = None,
) -> Path:
    """Write a checkpoint into `out_dir` in the published Hugging Face layout, with the modelling
    code and the tokenizer files that transformers' Auto classes load.

    The directory appears complete or not at all: it is written under a temporary name first.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    model, saved = _read_checkpoint(checkpoint_dir)
    tokenizer = _checkpoint_tokenizer(saved["config"])
    tmp = _fresh_dir(out_dir)
    try:
        token_ids: dict[str, Any] = {}
        if tokenizer is not None:
            token_ids = _write_tokenizer(tokenizer, model.cfg.max_seq_len, tmp)
        elif notes is not None:
            notes.append(
                f"no tokenizer.json found for {checkpoint_dir} (its dataset moved?): "
                f"AutoTokenizer will not load {out_dir}; copy the dataset's tokenizer.json there"
            )
        save_hf(model, tmp, max_shard_bytes=max_shard_bytes, **token_ids)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_tokenizer(tokenizer: Path, block_size: int, out_dir: Path) -> dict[str, Any]:
    """Copy tokenizer.json and the files carried next to it; write tokenizer_config.json and
    generation_config.json where none was carried. The special token ids, for config.json."""
    for name in CARRIED_FILES:
        if (tokenizer.parent / name).is_file():
            shutil.copyfile(tokenizer.parent / name, out_dir / name)
    shutil.copyfile(tokenizer, out_dir / TOKENIZER_NAME)
    for name, content in token_files(tokenizer, block_size).items():
        if not (out_dir / name).exists():
            (out_dir / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    try:
        generation = json.loads((out_dir / GENERATION_CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        generation = {}
    if not isinstance(generation, dict):
        return {}
    return {k: generation[k] for k in TOKEN_ID_FIELDS if generation.get(k) is not None}


def load_exported(out_dir: Path | str) -> RecurrentLM:
    """The RecurrentLM of a directory in the published layout, on CPU, in eval mode."""
    return load_hf(Path(out_dir))


def import_hf(
    hf_dir: Path | str,
    run_dir: Path | str,
    checkpoint_format: str = "full",
    notes: list[str] | None = None,
) -> Path:
    """A trainer checkpoint (step 0) in `run_dir` from a directory in the published layout.

    It holds the weights only: a `train` that resumes from it starts its optimizer state and
    schedule fresh. `checkpoint_format` is `full` (model.pt) or `sharded` (DCP shards, for runs
    with checkpoint.format=sharded). tokenizer.json and the files carried with it are copied into
    the run directory. What the import ignored or assumed is appended to `notes`.
    """
    hf_dir, run = Path(hf_dir), RunDir(run_dir)
    if checkpoint_format not in ("full", "sharded"):
        raise UserError(f"--format must be full or sharded, got {checkpoint_format!r}")
    if not is_hf_dir(hf_dir):
        raise UserError(
            f"{hf_dir} has no config.json with model.safetensors or model.safetensors.index.json"
        )
    if run.checkpoints():
        raise UserError(f"{run.path} already has checkpoints; import into a new run directory")
    model = load_hf(hf_dir, notes)
    run.create()
    config: dict[str, Any] = {"model": dataclasses.asdict(model.cfg), "imported_from": str(hf_dir)}
    if (hf_dir / TOKENIZER_NAME).is_file():
        for name in CARRIED_FILES:
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, run.path / name)
        config["tokenizer"] = str((run.path / TOKENIZER_NAME).resolve())
    state: dict[str, Any] = {
        "model": model.state_dict(),
        "optimizer": {},  # no optimizer state: training starts it fresh
        "scheduler": None,
        "scaler": None,
        "progress": {"step": 0, "tokens": 0, "sample_index": 0, "epoch": 0},
        "rng": [],
        "config": config,
        "version": trainer.__version__,
    }
    store = CheckpointStore(
        run,
        CheckpointConfig(
            verify="full", format="sharded" if checkpoint_format == "sharded" else "full"
        ),
        0,
        1,
    )
    with warnings.catch_warnings():  # DCP: "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        saved = store.save(0, state)
    if not saved:
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

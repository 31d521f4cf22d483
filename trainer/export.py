"""Export a checkpoint as safetensors + config.json + tokenizer, and generate text from either.

An export directory holds

    model.safetensors   the RecurrentLM weights (the head is tied to embedding.weight, stored once)
    config.json         the ModelConfig fields plus model_type/architectures/step
    tokenizer.json      copied from the dataset the run trained on, when it is still there

docs/checkpoints.md maps these names onto what a `transformers` modelling class would need.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from trainer.checkpoint import MODEL_FILE, TRAINER_STATE_FILE
from trainer.errors import UserError
from trainer.model import ModelConfig, RecurrentLM
from trainer.rundir import MANIFEST_NAME, verify_checkpoint, write_json_atomic

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
MODEL_TYPE = "rlm-recurrent"


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
    weights = torch.load(checkpoint_dir / MODEL_FILE, map_location="cpu", weights_only=True)
    model.load_state_dict(weights)
    return model.eval(), {"config": config, "step": info.step}


def _dataset_tokenizer(config: dict[str, Any]) -> Path | None:
    data_path = (config.get("data") or {}).get("path")
    if not data_path:
        return None
    path = Path(data_path) / TOKENIZER_NAME
    return path if path.is_file() else None


def export_checkpoint(checkpoint_dir: Path | str, out_dir: Path | str) -> Path:
    """Write model.safetensors, config.json and tokenizer.json for a checkpoint into `out_dir`.

    The directory appears complete or not at all: it is written under a temporary name first.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"{out_dir} already exists and is not empty; choose a new export directory")
    model, saved = _read_checkpoint(checkpoint_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_model(model, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        config = {
            "model_type": MODEL_TYPE,
            "architectures": ["RecurrentLM"],
            "tie_word_embeddings": True,
            "step": saved["step"],
            **dataclasses.asdict(model.cfg),
        }
        write_json_atomic(tmp / CONFIG_NAME, config)
        tokenizer = _dataset_tokenizer(saved["config"])
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
    """The RecurrentLM of an export directory, on CPU, in eval mode."""
    out_dir = Path(out_dir)
    try:
        values = json.loads((out_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(
            f"{out_dir} is not an export directory ({exc.__class__.__name__})"
        ) from None
    model = RecurrentLM(_model_config(values, out_dir))
    load_model(model, str(out_dir / WEIGHTS_NAME))
    return model.eval()


def _load_any(path: Path) -> tuple[RecurrentLM, Path | None]:
    """A model from a checkpoint or an export directory, with the tokenizer that belongs to it."""
    if (path / MANIFEST_NAME).exists():
        model, saved = _read_checkpoint(path)
        return model, _dataset_tokenizer(saved["config"])
    if (path / WEIGHTS_NAME).exists():
        tokenizer = path / TOKENIZER_NAME
        return load_exported(path), tokenizer if tokenizer.is_file() else None
    raise UserError(
        f"{path} is neither a checkpoint (manifest.json) nor an export (model.safetensors)"
    )


@torch.no_grad()
def generate_text(
    checkpoint_or_export_dir: Path | str,
    prompt: str,
    depth: int,
    max_new_tokens: int = 32,
    tokenizer_path: Path | str | None = None,
    top_k: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
) -> str:
    """The continuation of `prompt` at recurrence depth `depth`.

    top_k = 0 decodes greedily; otherwise samples from the k most likely tokens. `seed` fixes both
    the sampling and the model's random initial state, so equal arguments give equal text.
    """
    from tokenizers import Tokenizer

    if depth < 1 or max_new_tokens < 0 or top_k < 0 or temperature <= 0:
        raise UserError(
            "generate needs depth >= 1, max_new_tokens >= 0, top_k >= 0 and temperature > 0"
        )
    model, found_tokenizer = _load_any(Path(checkpoint_or_export_dir))
    tokenizer_file = Path(tokenizer_path) if tokenizer_path is not None else found_tokenizer
    if tokenizer_file is None or not tokenizer_file.is_file():
        raise UserError(
            f"no tokenizer.json found for {checkpoint_or_export_dir}; pass --tokenizer FILE"
        )
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise UserError("the prompt encodes to no tokens; give a non-empty --prompt")
    if max(ids) >= model.cfg.vocab_size:
        raise UserError(f"{tokenizer_file} does not match the model's vocabulary")
    generator = torch.Generator().manual_seed(seed)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([(ids + new)[-model.cfg.max_seq_len :]])
        logits = model(window, num_steps=depth, state_seeds=[seed]).logits[0, -1].float()
        if top_k == 0:
            token = int(logits.argmax())
        else:
            top = torch.topk(logits / temperature, min(top_k, logits.numel()))
            choice = torch.multinomial(top.values.softmax(-1), 1, generator=generator)
            token = int(top.indices[choice])
        new.append(token)
    return tokenizer.decode(new)

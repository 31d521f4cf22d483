"""Export to safetensors and back, and text generation from checkpoints and exports."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trainer.checkpoint import MODEL_FILE, CheckpointConfig, CheckpointStore
from trainer.errors import UserError
from trainer.export import export_checkpoint, generate_text, load_exported
from trainer.model import PRESETS, RecurrentLM
from trainer.rundir import RunDir


@pytest.fixture(scope="module")
def checkpoint(
    tmp_path_factory: pytest.TempPathFactory, prepared_data: Path
) -> tuple[Path, RecurrentLM]:
    """A checkpoint of a tiny model with perturbed weights, saved the way the loop saves it."""
    torch.manual_seed(1)
    model = RecurrentLM(PRESETS["tiny"]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # norms are no longer all ones
    run = RunDir(tmp_path_factory.mktemp("run")).create()
    config = {
        "model": {"preset": "tiny", **dataclasses.asdict(model.cfg)},
        "data": {"path": str(prepared_data), "split": "train"},
    }
    state = {
        "model": model.state_dict(),
        "optimizer": {},
        "progress": {"step": 7},
        "config": config,
    }
    assert CheckpointStore(run, CheckpointConfig(), 0, 1).save(7, state)
    return run.checkpoint_path(7), model


def test_export_round_trip_gives_identical_logits(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path
) -> None:
    ckpt, original = checkpoint
    out = export_checkpoint(ckpt, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "rlm-recurrent" and config["step"] == 7
    assert config["d_model"] == original.cfg.d_model and config["tie_word_embeddings"] is True
    with safe_open(out / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(original.state_dict())  # the head is embedding.weight

    exported = load_exported(out)
    ids = torch.randint(
        0, original.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want = original(ids, num_steps=3, state_seeds=[1, 2]).logits
        got = exported(ids, num_steps=3, state_seeds=[1, 2]).logits
    assert torch.equal(want, got)


def test_generate_from_checkpoint_and_export_agree(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path
) -> None:
    ckpt, _ = checkpoint
    out = export_checkpoint(ckpt, tmp_path / "export")
    text = generate_text(ckpt, "The module", depth=2, max_new_tokens=6)
    assert isinstance(text, str) and text
    assert generate_text(out, "The module", depth=2, max_new_tokens=6) == text
    sampled = generate_text(out, "The module", depth=2, max_new_tokens=6, top_k=20, seed=3)
    assert sampled == generate_text(out, "The module", depth=2, max_new_tokens=6, top_k=20, seed=3)


def test_export_refuses_a_non_empty_target_and_a_damaged_checkpoint(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path
) -> None:
    ckpt, _ = checkpoint
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        export_checkpoint(ckpt, taken)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]

    damaged = tmp_path / "step-00000007"
    damaged.mkdir()
    for src in ckpt.iterdir():
        (damaged / src.name).write_bytes(src.read_bytes())
    os.truncate(damaged / MODEL_FILE, 10)
    with pytest.raises(UserError, match="not a usable checkpoint"):
        export_checkpoint(damaged, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="neither a checkpoint"):
        generate_text(tmp_path, "x", depth=1)

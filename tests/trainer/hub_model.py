"""A small Huginn whose weights are a formula, not a draw from torch's RNG, so that logits the
published code computed from it once (fixtures/raven_reference.json, recorded by
record_raven_reference.py) stay comparable whatever the trainer's initialisation does."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch

from trainer.checkpoint import CheckpointConfig, CheckpointStore
from trainer.model import PRESETS, ModelConfig, RecurrentLM
from trainer.rundir import RunDir

FIXTURE = Path(__file__).parent / "fixtures" / "raven_reference.json"
SMALL = ModelConfig(
    vocab_size=256, d_model=32, n_heads=2, mlp_hidden=64, n_prelude=1, n_core=2, n_coda=1,
    max_seq_len=32, mean_recurrence=4, backprop_depth=2,
)  # fmt: skip
IDS = [[5, 17, 200, 3, 99, 42, 7, 128]]
NUM_STEPS = 4


def formula_model(cfg: ModelConfig = SMALL) -> RecurrentLM:
    """Every parameter k: scale · sin(0.37 i + k) over its flat index i, in float64 rounded to
    float32 (norm gains around 1)."""
    model = RecurrentLM(cfg).eval()
    with torch.no_grad():
        for k, (name, p) in enumerate(sorted(model.named_parameters())):
            wave = torch.sin(torch.arange(p.numel(), dtype=torch.float64) * 0.37 + k)
            norm = name.split(".")[-2] in ("n1", "n2", "n3", "n4", "ln_f")
            values = 1 + 0.1 * wave if norm else 0.15 * wave
            p.copy_(values.view_as(p).float())
    return model


def perturbed_tiny(seed: int, scale: float) -> RecurrentLM:
    """The tiny preset with seeded noise on every parameter (norm gains, qk biases not trivial)."""
    torch.manual_seed(seed)
    model = RecurrentLM(PRESETS["tiny"]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def initial_state(cfg: ModelConfig = SMALL) -> torch.Tensor:
    """A fixed latent start state s₀ for IDS: (1, len, d)."""
    t = len(IDS[0])
    wave = torch.cos(torch.arange(t * cfg.d_model, dtype=torch.float64) * 0.11)
    return wave.view(1, t, cfg.d_model).float()


def save_checkpoint(
    model: RecurrentLM, run_dir: Path, step: int, data_path: Path | None, fmt: str = "full"
) -> Path:
    """A checkpoint of `model` as the training loop saves one (full or sharded)."""
    run = RunDir(run_dir).create()
    config = {"model": dataclasses.asdict(model.cfg)}
    if data_path is not None:
        config["data"] = {"path": str(data_path), "split": "train"}
    state = {"model": model.state_dict(), "optimizer": {}, "progress": {"step": step}}
    state["config"] = config
    store = CheckpointStore(run, CheckpointConfig(format=fmt), 0, 1)  # type: ignore[arg-type]
    with warnings.catch_warnings():  # DCP: "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        assert store.save(step, state)
    return run.checkpoint_path(step)

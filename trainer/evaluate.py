"""Validation: loss and perplexity of a fixed slice of the val split at several recurrence depths,
during training and from the CLI (`python -m trainer evaluate`, with a plot as in the paper)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer import distributed
from trainer.config import Config
from trainer.data import TokenDataset, rank_positions, sample_seed
from trainer.distributed import DistEnv


@torch.no_grad()
def evaluate(model: nn.Module, ds: TokenDataset, cfg: Config, env: DistEnv) -> dict[int, float]:
    """Mean token loss per depth in `cfg.eval.depths` over `eval.batches` global batches.

    The slice is the first eval.batches × global_batch samples of the split (wrapping around a
    small split) with state seeds from their positions, so every evaluation of a run, at any world
    size, sees the same tokens and the same latent noise. `model` is the unwrapped module: DDP's
    forward hooks are for training only.
    """
    t = cfg.train
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
    return losses_by_depth(
        model, ds, cfg.eval.depths, cfg.eval.batches, t.global_batch, t.micro_batch, cfg.seed,
        dtype, env,
    )  # fmt: skip


@torch.no_grad()
def losses_by_depth(
    model: nn.Module,
    ds: TokenDataset,
    depths: Sequence[int],
    batches: int,
    global_batch: int,
    micro_batch: int,
    seed: int,
    dtype: torch.dtype | None,
    env: DistEnv,
) -> dict[int, float]:
    """Mean token loss at each depth over the first batches × global_batch samples of `ds`."""
    was_training = model.training
    model.eval()
    losses = {}
    for depth in depths:
        loss_sum = 0.0
        for batch in range(batches):
            start = batch * global_batch
            positions = rank_positions(start, global_batch, env.rank, env.world_size)
            for offset in range(0, len(positions), micro_batch):
                micro = positions[offset : offset + micro_batch]
                samples = torch.stack([ds[p % len(ds)] for p in micro]).to(env.device)
                seeds = [sample_seed(seed, p) for p in micro]
                with torch.autocast(env.device.type, dtype=dtype, enabled=dtype is not None):
                    out = model(
                        samples[:, :-1],
                        samples[:, 1:],
                        num_steps=depth,
                        backprop_depth=0,
                        state_seeds=seeds,
                    )
                loss_sum += float(out.loss) * len(micro)
        (total,) = distributed.all_reduce_sum([loss_sum], env)
        losses[depth] = total / (batches * global_batch)
    model.train(was_training)
    return losses


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def plot_depths(losses: dict[int, float], path: Path, title: str) -> Path:
    """A PNG of validation perplexity against recurrence depth (log-scaled depth axis)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on nodes and in CI
    from matplotlib import pyplot as plt

    depths = sorted(losses)
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
    ax.plot(depths, [perplexity(losses[d]) for d in depths], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("recurrence depth r (test time)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def evaluate_checkpoint(
    path: Path,
    data: Path | None,
    depths: Sequence[int],
    split: str = "val",
    batches: int = 2,
    batch_size: int = 8,
    seed: int = 0,
    plot: Path | None = None,
) -> dict[str, Any]:
    """Perplexity per depth of a checkpoint or export on a prepared dataset's split (one process,
    CPU); the report `evaluate --json` prints."""
    from trainer.data import TokenDataset
    from trainer.errors import DataError, UserError
    from trainer.export import checkpoint_data_path, load_any

    if not depths or min(depths) < 1:
        raise UserError(f"--depths must be depths >= 1, got {list(depths)}")
    model, _ = load_any(path)
    data = data or checkpoint_data_path(path)
    if data is None or not Path(data).exists():
        raise DataError(f"no dataset for {path}: pass --data DIR (a `prepare`d dataset)")
    ds = TokenDataset(Path(data), split)
    if ds.seq_len > model.cfg.max_seq_len or ds.vocab_size > model.cfg.vocab_size:
        raise DataError(
            f"{data} (seq_len {ds.seq_len}, vocab {ds.vocab_size}) does not fit the model"
        )
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    losses = losses_by_depth(model, ds, depths, batches, batch_size, batch_size, seed, None, env)
    report: dict[str, object] = {
        "checkpoint": str(path),
        "data": str(data),
        "split": split,
        "samples": batches * batch_size,
        "tokens": batches * batch_size * (ds.seq_len - 1),
        "depths": {str(d): {"loss": v, "perplexity": perplexity(v)} for d, v in losses.items()},
    }
    if plot is not None:
        title = f"{Path(path).name}: {split} perplexity against depth"
        report["plot"] = str(plot_depths(losses, plot, title))
    return report

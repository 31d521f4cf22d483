"""Validation: loss and perplexity of a fixed slice of the val split at several recurrence depths."""

from __future__ import annotations

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
    was_training = model.training
    model.eval()
    t = cfg.train
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
    losses = {}
    for depth in cfg.eval.depths:
        loss_sum = 0.0
        for batch in range(cfg.eval.batches):
            start = batch * t.global_batch
            positions = rank_positions(start, t.global_batch, env.rank, env.world_size)
            for offset in range(0, len(positions), t.micro_batch):
                micro = positions[offset : offset + t.micro_batch]
                samples = torch.stack([ds[p % len(ds)] for p in micro]).to(env.device)
                seeds = [sample_seed(cfg.seed, p) for p in micro]
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
        losses[depth] = total / (cfg.eval.batches * t.global_batch)
    model.train(was_training)
    return losses

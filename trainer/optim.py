"""AdamW and the learning-rate schedules (linear warmup, then cosine or warmup-stable-decay)."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only: norm gains are not decayed, and neither is the
    (tied) embedding, whose rows of rare tokens would otherwise shrink towards zero."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 and "embedding" not in name else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused kernel runs one launch per step on GPUs (and exists for CPU too since torch 2.4).
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: constant until the cooldown, then linear decay to the floor at the last step.
    cooldown = max(1, round(cfg.cooldown_fraction * total_steps))
    start = total_steps - cooldown
    if step < start:
        return 1.0
    return 1 - (1 - floor) * min(1.0, (step - start + 1) / cooldown)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg)
    )

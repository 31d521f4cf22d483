"""FLOPs per token for the depth actually executed, and the peak FLOP/s that MFU divides by.

Convention (PaLM appendix B, as used by nanoGPT and torchtitan), per token of a sequence of T:

* A matmul with N weights costs 2·N FLOPs forward and 4·N backward (input and weight grads),
  so a differentiated layer costs 6·N and a layer run under `torch.no_grad()` costs 2·N.
* Counted weights: every block (prelude, core, coda, including their RMSNorm gains and qk
  bias), the adapter, the final norm `ln_f` twice (it runs after the recurrence and again
  before the head), and the tied head's logits matmul (d·vocab, so 6·d·vocab when
  trained). The embedding lookup is a gather and costs nothing.
* Attention scores and the weighted sum (QKᵀ and AV) add 2·2·H·Q·T forward per layer, i.e.
  12·H·Q·T when differentiated and 4·H·Q·T without backward. Like PaLM we do not halve for the
  causal mask.
* Of the r core iterations only the last k' = min(k, r) are differentiated; the other r − k'
  are forward only (and with k' = 0 so is the prelude, which then receives no gradient). Recompute from activation checkpointing (one more forward of the k'
  iterations) is hardware work, not model work: it is reported as `recompute`, never in `useful`.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

import torch

from clusterspec import vendors
from trainer.distributed import synchronize
from trainer.model import ModelConfig, ParamCounts, RecurrentLM


@dataclass(frozen=True)
class FlopsPerToken:
    useful: float  # model FLOPs of one training step per token: the MFU numerator
    recompute: float  # extra forward FLOPs from activation checkpointing (0 when off)
    inference: float  # forward-only FLOPs per token at the same depth (evaluation, generation)

    @property
    def hardware(self) -> float:
        """What the device actually executes per token (useful + recompute)."""
        return self.useful + self.recompute


@functools.lru_cache(maxsize=32)
def _param_counts(shape: tuple[Any, ...]) -> ParamCounts:
    with torch.device("meta"):
        return RecurrentLM(ModelConfig(*shape)).param_counts()


def flops_per_token(
    cfg: ModelConfig, num_steps: int, backprop_depth: int, seq_len: int
) -> FlopsPerToken:
    """FLOPs per token of a training step that runs `num_steps` core iterations and
    differentiates the last min(backprop_depth, num_steps) of them, at sequence length seq_len."""
    counts = _param_counts(astuple(cfg))
    grad_steps = min(backprop_depth, num_steps)
    nograd_steps = num_steps - grad_steps
    # With no differentiated iteration the prelude gets no gradient: it runs forward only.
    prelude_passes = 3 if grad_steps else 1
    head = counts.embedding  # the tied head's logits matmul
    per_step = counts.core + counts.adapter
    attn = 2 * 2 * cfg.d_model * seq_len  # QKᵀ and AV per layer per token, forward

    useful = (
        2 * prelude_passes * counts.prelude
        + 6 * (counts.coda + 2 * counts.norm + head)
        + 6 * grad_steps * per_step
        + 2 * nograd_steps * per_step
        + attn * prelude_passes * cfg.n_prelude
        + 3 * attn * (cfg.n_coda + cfg.n_core * grad_steps)
        + attn * cfg.n_core * nograd_steps
    )
    recompute = 0.0
    if cfg.activation_checkpointing:
        recompute = grad_steps * (2 * per_step + attn * cfg.n_core)
    fixed = counts.prelude + counts.coda + 2 * counts.norm + head
    layers = cfg.n_prelude + cfg.n_coda + cfg.n_core * num_steps
    inference = 2 * (fixed + num_steps * per_step) + attn * layers
    return FlopsPerToken(
        useful=float(useful), recompute=float(recompute), inference=float(inference)
    )


def measure_gemm_flops(
    dtype: torch.dtype,
    size: int = 1024,
    seconds: float = 0.5,
    device: str | torch.device = "cpu",
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Achievable matmul FLOP/s: the best of repeated size×size×size linear-layer matmuls over ~`seconds`
    (at least 3 timed runs after one warm-up), counted as 2·size³ FLOPs each. The best run,
    not the mean, because other processes on a shared host only ever slow a run down. Uses
    the current torch.get_num_threads(). `clock=time.process_time` gives FLOPs per CPU-second,
    which a busy host distorts less than wall time."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    # F.linear (a @ b.T), the kernel of every nn.Linear: on CPU plain torch.mm has no fast fp16
    # path (0.6 vs 14-20 GFLOP/s measured), which put fp16 MFU at ~400 %.
    torch.nn.functional.linear(a, b)  # warm-up: kernel selection, lazy initialisation
    synchronize(device)
    best = math.inf
    runs = 0
    deadline = time.perf_counter() + seconds
    while runs < 3 or time.perf_counter() < deadline:
        start = clock()
        torch.nn.functional.linear(a, b)
        synchronize(device)
        best = min(best, clock() - start)
        runs += 1
    return 2 * size**3 / best


@functools.lru_cache(maxsize=8)
def _measured_peak(device: torch.device, dtype: torch.dtype) -> float:
    return measure_gemm_flops(dtype, device=device)


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from) for MFU.

    Known accelerators in bf16/fp16 use the datasheet table; anything else (CPU, fp32, an
    unknown GPU) is measured once per process with `measure_gemm_flops`. A bf16/fp16 step runs
    under autocast, which leaves some matmuls in fp32 (the loss head over the fp32 residual
    stream); a measured peak is therefore the faster of the autocast dtype and fp32. On a CPU
    without fast fp16 kernels the fp16 probe alone is 10-60x below fp32 and put MFU at ~400 %.
    """
    device = torch.device(device)
    if device.type != "cpu" and dtype in (torch.bfloat16, torch.float16):
        name = getattr(torch, device.type).get_device_name(device)
        # The vendor descriptions hold the datasheet peaks per SKU (longest matching key wins).
        peak, key = vendors.peak_bf16_flops(name)
        if peak is not None:
            return peak, f"datasheet {key} ({name})"
    if dtype == torch.float32:
        return _measured_peak(device, dtype), f"measured GEMM probe on {device.type} ({dtype})"
    peaks = {d: _measured_peak(device, d) for d in (dtype, torch.float32)}
    probed = ", ".join(f"{str(d).removeprefix('torch.')} {p / 1e9:.1f}" for d, p in peaks.items())
    return max(peaks.values()), f"measured GEMM probe on {device.type}: fastest of {probed} GFLOP/s"

"""The depth-recurrent language model (Huginn-style): prelude → core looped r times → coda.

    tokens ─► embedding·√d ─► prelude (P blocks) ─► e
    s₀ ~ truncated normal, fresh each forward
    repeat r times:  s = core(adapter(concat(s, e)))          (C blocks per iteration)
    ln_f(s) ─► coda (K blocks) ─► ln_f ─► logits = x · embeddingᵀ (tied head)

This is the published Huginn-3.5B architecture (seal-rg/recurrent-pretraining): attention adds a
learned per-head bias to q and k before RoPE, RoPE rotates interleaved pairs (x₂ᵢ, x₂ᵢ₊₁) in
fp32, and one final RMSNorm (`ln_f`) is applied twice, after the recurrence and before the head.

Only the last min(k, r) core iterations are differentiated (truncated backprop through depth);
the earlier ones run under `torch.no_grad()`. The depth r is drawn per optimizer step by
`sample_recurrence`, identically on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# The schema lives in the run contract; these names stay importable from here.
from runcontract.config import PRESETS as PRESETS
from runcontract.config import ModelConfig as ModelConfig
from runcontract.config import model_config as model_config
from runcontract.errors import ConfigError


def sample_recurrence(
    seed: int, step: int, mean: float, sigma: float = 0.5, micro_batch: int | None = None
) -> int:
    """Depth r for one optimizer step: λ ~ LogNormal(ln(mean) − σ²/2, σ), r = Poisson(λ) + 1.

    E[λ] = mean, so E[r] = mean + 1. The draw depends only on (seed, step), never on global RNG
    state: every rank gets the same r and a resumed run replays the same depths. With
    `micro_batch`, one draw per micro-batch of the step (the same on every rank: lockstep).
    """
    rng = np.random.default_rng([seed, step] if micro_batch is None else [seed, step, micro_batch])
    lam = rng.lognormal(math.log(mean) - sigma**2 / 2, sigma)
    return int(rng.poisson(lam)) + 1


def rope_cache(head_dim: int, seq_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables of shape (seq_len, head_dim / 2): angle t·base^(−2i/head_dim) for pair i."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x₂ᵢ, x₂ᵢ₊₁) of x: (B, T, ..., D) by cos/sin: (T, D/2).

    The rotation runs in fp32 whatever x's dtype (positions far into a 4096 context lose their
    angle in bf16); the result has x's dtype. It is one complex multiplication per pair,
    (x₂ᵢ + i·x₂ᵢ₊₁)(cos + i·sin): the same products and sums as the real formula, in one pass
    over contiguous memory instead of six over strided halves (compiled: the real formula).
    """
    if cos.dtype not in _ROPE_DTYPES or sin.dtype not in _ROPE_DTYPES:
        # A cast of the tables (FSDP's MixedPrecisionPolicy casts floating forward arguments
        # when cast_forward_inputs=True, `model.to(torch.bfloat16)` casts buffers) would lose
        # the angle precision silently; refuse it loudly, in eager and compiled code alike.
        raise RuntimeError(
            f"RoPE tables arrived in {cos.dtype}/{sin.dtype}; they must stay fp32 "
            "(keep the model's buffers in fp32, FSDP with cast_forward_inputs=False)"
        )
    shape = (x.shape[1],) + (1,) * (x.dim() - 3) + (x.shape[-1] // 2,)
    if torch.compiler.is_compiling():  # inductor fuses the real formula; it has no complex codegen
        cos, sin = cos.view(shape), sin.view(shape)
        even, odd = _at_least_fp32(x).unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
        return rotated.flatten(-2).to(x.dtype)
    pairs = torch.view_as_complex(_at_least_fp32(x).contiguous().unflatten(-1, (-1, 2)))
    rotated = pairs * torch.complex(cos, sin).view(shape)
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


_ROPE_DTYPES = (torch.float32, torch.float64)


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or in its own dtype when that is wider (float64 in the golden tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# Rows of fp32 logits alive at once in the loss: 2²⁶ floats (256 MiB), e.g. 1024 rows at vocab 65536.
LOSS_CHUNK_ELEMENTS = 1 << 26


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `x @ weightᵀ` against labels, a chunk of rows at a time.

    The gradients (softmax − one-hot) are formed chunk by chunk during the forward, so the
    (tokens × vocab) fp32 logits are never materialised whole and nothing is recomputed: the
    matmuls are the same three a plain linear + cross-entropy runs.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:
        grad_x, grad_w, total, count = _linear_cross_entropy(x, weight, labels, chunk, True)
        assert grad_x is not None and grad_w is not None  # grads=True computes both
        ctx.save_for_backward(grad_x / count, grad_w / count)
        return total / count

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        grad_x, grad_w = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad_x * grad_loss.to(grad_x.dtype), grad_w * grad_loss, None, None


def _linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, grads: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(d sum/dx, d sum/dweight, sum of token losses, count of labelled tokens); x: (N, d)."""
    with torch.autocast(x.device.type, enabled=False):
        w = weight.to(x.dtype)  # under bf16 autocast: the one cast of the head per step
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if grads else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if grads else None
        for start in range(0, x.shape[0], chunk):
            rows, targets = x[start : start + chunk], labels[start : start + chunk]
            logits = F.linear(rows, w).float()
            lse = logits.logsumexp(-1)
            keep = targets != -100
            picked = targets.clamp(min=0)
            target_logits = logits.gather(1, picked[:, None])[:, 0]
            total += torch.where(keep, lse - target_logits, 0.0).sum()
            if grads:
                assert grad_x is not None and grad_w is not None
                g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                g.scatter_add_(1, picked[:, None], -keep[:, None].to(g.dtype))
                if not keep.all():  # rows without a label get no gradient
                    g.mul_(keep[:, None])
                g = g.to(x.dtype)
                grad_x[start : start + chunk] = g @ w
                grad_w += (g.t() @ rows).float()
        count = (labels != -100).sum().clamp(min=1).to(torch.float32)
    return grad_x, grad_w, total, count


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """F.cross_entropy(F.linear(x, weight).float(), labels, ignore_index=-100) for x: (..., d),
    labels: (...), without materialising all logits; `chunk` rows at a time (default: 256 MiB
    of fp32 logits)."""
    x, labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
    chunk = chunk or max(1, LOSS_CHUNK_ELEMENTS // weight.shape[0])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(x, weight, labels, chunk)
    _, _, total, count = _linear_cross_entropy(x, weight, labels, chunk, False)
    return total / count


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 even under bf16 autocast: a mean of bf16 squares loses precision.
        # The gain too: FSDP gathers it in the training dtype (bf16) for the forward.
        x32 = _at_least_fp32(x)
        return F.rms_norm(x32, (x.shape[-1],), self.weight.to(x32.dtype), self.eps).to(x.dtype)


class KVCache:
    """Keys and values of the positions decoded so far, per attention layer execution:
    ("prelude", i), ("core", iteration, i), ("coda", i): each core iteration has its own."""

    def __init__(self) -> None:
        self.keys: dict[tuple[Any, ...], torch.Tensor] = {}
        self.values: dict[tuple[Any, ...], torch.Tensor] = {}

    def extend(
        self, layer: tuple[Any, ...], k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, heads, t, head_dim) to `layer`'s entries; all of them."""
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def length(self, layer: tuple[Any, ...]) -> int:
        return self.keys[layer].shape[2] if layer in self.keys else 0


class CacheSlot(NamedTuple):
    cache: KVCache
    layer: tuple[Any, ...]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        # Learned per-head bias of q (index 0) and k (index 1), added before RoPE.
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, cfg.n_heads, cfg.head_dim))
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot: CacheSlot | None = None
    ) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim)
        # q and k biased and rotated in fp32, then back to the activations' dtype; the add
        # promotes bf16 + fp32 to fp32 itself, so q and k are not copied to fp32 first
        qk = qkv[:, :, :2] + _at_least_fp32(self.qk_bias).transpose(0, 1)
        q, k = apply_rope(qk, cos, sin).to(qkv.dtype).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
        if slot is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # decoding: attend to the cached keys of earlier positions too
            k, v = slot.cache.extend(slot.layer, k, v)
            start = k.shape[2] - t
            mask = None  # one new position sees every cached one
            if t > 1:
                rows = torch.arange(start, start + t, device=x.device)[:, None]
                mask = torch.arange(k.shape[2], device=x.device)[None, :] <= rows
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.mlp_hidden, bias=False)
        self.proj = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class Block(nn.Module):
    """Sandwich-norm block: x = n2(attn(n1(x)) + x); x = n4(mlp(n3(x)) + x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n1, self.n2, self.n3, self.n4 = (RMSNorm(cfg.d_model, cfg.norm_eps) for _ in range(4))
        self.attn = Attention(cfg)
        self.mlp = SwiGLU(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot: CacheSlot | None = None
    ) -> torch.Tensor:
        x = self.n2(self.attn(self.n1(x), cos, sin, slot) + x)
        return self.n4(self.mlp(self.n3(x)) + x)


class ModelOutput(NamedTuple):
    logits: torch.Tensor | None  # None when labels are given: the loss never needs them whole
    loss: torch.Tensor | None
    num_steps: int


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # tied with the head, counted once
    prelude: int
    adapter: int
    core: int
    coda: int
    norm: int  # the final RMSNorm `ln_f` (one module, applied twice)

    @property
    def total(self) -> int:
        return self.embedding + self.non_embedding

    @property
    def non_embedding(self) -> int:
        return self.prelude + self.adapter + self.core + self.coda + self.norm


class RecurrentLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d = cfg.d_model
        self.embedding = nn.Embedding(cfg.vocab_size, d)
        self.prelude = nn.ModuleList(Block(cfg) for _ in range(cfg.n_prelude))
        self.adapter = nn.Linear(2 * d, d, bias=False)
        self.core = nn.ModuleList(Block(cfg) for _ in range(cfg.n_core))
        self.coda = nn.ModuleList(Block(cfg) for _ in range(cfg.n_coda))
        self.ln_f = RMSNorm(d, cfg.norm_eps)  # after the recurrence and again before the head
        half = cfg.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half), False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half), False)
        self.init_weights()
        if cfg.compile:
            for block in (*self.prelude, *self.core, *self.coda):
                block.compile()

    @property
    def init_std(self) -> float:
        return math.sqrt(2 / (5 * self.cfg.d_model))

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise parameters and RoPE tables, e.g. after `to_empty()` from meta."""
        for name, p in self.named_parameters():
            self.init_parameter(name, p)
        self.reset_rope()

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Initialise the full tensor of parameter `name` in place (draws from torch's RNG in
        `named_parameters` order; sharded init in trainer/parallel.py draws the same)."""
        std = self.init_std
        out_std = std / math.sqrt(2 * self.cfg.effective_depth)
        with torch.no_grad():
            if name.endswith(("n1.weight", "n2.weight", "n3.weight", "n4.weight", "ln_f.weight")):
                tensor.fill_(1.0)
            elif name.endswith("qk_bias"):
                tensor.zero_()
            else:
                s = out_std if name.endswith("proj.weight") else std
                nn.init.trunc_normal_(tensor, std=s, a=-3 * s, b=3 * s)

    def reset_rope(self) -> None:
        """(Re)compute the fp32 RoPE tables, once per model and device (not per forward)."""
        cos, sin = rope_cache(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_base)
        device = self.embedding.weight.device
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def param_counts(self) -> ParamCounts:
        """Parameter counts by group; works on the meta device (nothing is allocated)."""

        def count(*modules: nn.Module) -> int:
            return sum(p.numel() for m in modules for p in m.parameters())

        return ParamCounts(
            embedding=count(self.embedding),
            prelude=count(self.prelude),
            adapter=count(self.adapter),
            core=count(self.core),
            coda=count(self.coda),
            norm=count(self.ln_f),
        )

    def initial_state(
        self,
        like: torch.Tensor,
        state_seeds: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """s₀ with the shape/device/dtype of `like`: truncated normal (±3σ) scaled by √d.

        With `state_seeds`, sample i is drawn from its own generator seeded with state_seeds[i], so
        a sample's forward does not depend on which batch or rank it lands in; otherwise from
        `generator` (default: the global one).
        """
        std = self.init_std
        s = torch.empty(like.shape, device=like.device, dtype=torch.float32)
        if state_seeds is None:
            nn.init.trunc_normal_(s, std=std, a=-3 * std, b=3 * std, generator=generator)
        else:
            if len(state_seeds) != like.shape[0]:
                raise ValueError(f"{len(state_seeds)} state_seeds for a batch of {like.shape[0]}")
            for row, seed in zip(s, state_seeds, strict=True):
                gen = torch.Generator(device=like.device).manual_seed(int(seed))
                nn.init.trunc_normal_(row, std=std, a=-3 * std, b=3 * std, generator=gen)
        return (s * math.sqrt(self.cfg.d_model)).to(like.dtype)

    def core_step(
        self,
        s: torch.Tensor,
        e: torch.Tensor,
        t: int,
        start: int = 0,
        cache: KVCache | None = None,
        iteration: int = 0,
    ) -> torch.Tensor:
        """One iteration of the recurrence: adapter(concat(s, e)) then the C core blocks, for
        positions start..start+t (decoding with `cache` keeps keys per iteration)."""
        cos, sin = self.rope_cos[start : start + t], self.rope_sin[start : start + t]
        x = self.adapter(torch.cat((s, e), dim=-1))
        for i, block in enumerate(self.core):
            x = block(x, cos, sin, CacheSlot(cache, ("core", iteration, i)) if cache else None)
        return x

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding × √d, the start of the residual stream, in fp32 (or wider) whatever dtype
        the weights are used in: under FSDP's bf16 parameters as under DDP's bf16 autocast,
        the stream, its norms and RoPE stay fp32 and only the matmuls run in bf16."""
        return _at_least_fp32(self.embedding(input_ids)) * math.sqrt(self.cfg.d_model)

    # Decoding with a KV cache (trainer/generate.py): the forward pass in three parts.
    def embed(self, input_ids: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        """The prelude output e for tokens at positions start.. (their keys join the cache)."""
        t = input_ids.shape[1]
        cos, sin = self.rope_cos[start : start + t], self.rope_sin[start : start + t]
        x = self.embed_tokens(input_ids)
        for i, block in enumerate(self.prelude):
            x = block(x, cos, sin, CacheSlot(cache, ("prelude", i)))
        return x

    def head(self, s: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        """Logits from the latent state s: ln_f, the coda (keys cached), ln_f, tied head."""
        t = s.shape[1]
        cos, sin = self.rope_cos[start : start + t], self.rope_sin[start : start + t]
        x = self.ln_f(s)
        for i, block in enumerate(self.coda):
            x = block(x, cos, sin, CacheSlot(cache, ("coda", i)))
        return F.linear(self.ln_f(x), self.embedding.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        num_steps: int | None = None,
        backprop_depth: int | None = None,
        state_seeds: Sequence[int] | None = None,
        state: torch.Tensor | None = None,
    ) -> ModelOutput:
        """input_ids, labels: (B, T) token ids; labels[b, t] is the target for position t
        (already shifted by the caller, nanoGPT style); -100 is ignored in the loss.
        num_steps defaults to cfg.mean_recurrence, backprop_depth to cfg.backprop_depth.
        With labels the output has the fp32 loss and no logits (`linear_cross_entropy`).
        `state` replaces the random initial latent state s₀ (B, T, d)."""
        cfg = self.cfg
        r = cfg.mean_recurrence if num_steps is None else num_steps
        k = cfg.backprop_depth if backprop_depth is None else backprop_depth
        if r < 1 or k < 0:
            raise ConfigError(
                f"recurrence depth must be >= 1 and backprop depth >= 0, got {r}, {k}"
            )
        t = input_ids.shape[1]
        if t > cfg.max_seq_len:
            raise ConfigError(f"sequence length {t} exceeds model.max_seq_len={cfg.max_seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]

        x = self.embed_tokens(input_ids)
        for block in self.prelude:
            x = block(x, cos, sin)
        e = x

        s = self.initial_state(e, state_seeds) if state is None else state.to(e.dtype)
        with_grad = min(k, r)
        with torch.no_grad():
            for _ in range(r - with_grad):
                s = self.core_step(s, e, t)
        for _ in range(with_grad):
            if cfg.activation_checkpointing and torch.is_grad_enabled():
                s = checkpoint(self.core_step, s, e, t, use_reentrant=False)
            else:
                s = self.core_step(s, e, t)

        x = self.ln_f(s)
        for block in self.coda:
            x = block(x, cos, sin)
        x = self.ln_f(x)
        if labels is not None:
            loss = linear_cross_entropy(x, self.embedding.weight, labels)
            return ModelOutput(logits=None, loss=loss, num_steps=r)
        logits = F.linear(x, self.embedding.weight)
        return ModelOutput(logits=logits, loss=None, num_steps=r)

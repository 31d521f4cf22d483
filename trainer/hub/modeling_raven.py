"""RavenForCausalLM: the published Huginn architecture as a transformers PreTrainedModel.

Shipped into every export directory by `python -m trainer export` (rlm-ops, trainer/hub/) and
loaded with `AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)`. The module tree
is the published one, so the export's tensors load by name with nothing missing or unexpected:

    transformer.wte            token embedding (× √d), tied with lm_head
    transformer.prelude.i      sandwich blocks run once
    transformer.adapter        Linear(2d → d) on concat(state, prelude output), each iteration
    transformer.core_block.i   sandwich blocks run `num_steps` times
    transformer.coda.i         sandwich blocks run once
    transformer.ln_f           one RMSNorm, applied after the recurrence and before the head
    freqs_cis                  RoPE cos/sin table (1, block_size, 1, head_dim/2, 2), fp32

Each forward starts the latent state from a fresh truncated normal (±3σ, σ = √(2/5d), × √d) drawn
from torch's global generator (or takes `input_states`), iterates the core `num_steps` times
(default: the config's `mean_recurrence`) and decodes. `model.generate(ids, num_steps=r)` sets the
depth per call; decoding keeps keys and values per block and per iteration (`RecurrentCache`).
`labels` follow the transformers convention (the loss shifts them by one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_raven import RavenConfig

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or in its own dtype when that is wider (float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rope_table(head_dim: int, length: int, base: float) -> torch.Tensor:
    """cos/sin of position t · base^(−2i/head_dim) for pair i, in fp32: (1, length, 1, head_dim/2, 2)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)[None, :, None]


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x₂ᵢ, x₂ᵢ₊₁) of x (B, T, heads, head_dim) by table (B|1, T, 1,
    head_dim/2, 2), in fp32 or wider; the result has x's dtype."""
    pairs = _wide(x).unflatten(-1, (-1, 2))
    cos, sin = table[..., 0].to(pairs.dtype), table[..., 1].to(pairs.dtype)
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).flatten(-2).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # statistics in fp32 under bf16
        return F.rms_norm(_wide(x), (x.shape[-1],), self.weight, self.eps).to(x.dtype)


class RecurrentCache:
    """Keys and values per attention execution: ("prelude", i), ("core", iteration, i),
    ("coda", i). Every iteration of the recurrence attends with keys of its own."""

    def __init__(self) -> None:
        self.keys: dict[tuple[Any, ...], torch.Tensor] = {}
        self.values: dict[tuple[Any, ...], torch.Tensor] = {}
        self.seen_tokens = 0  # positions whose keys are cached

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer: tuple[Any, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            key = torch.cat((self.keys[layer], key), dim=2)
            value = torch.cat((self.values[layer], value), dim=2)
        self.keys[layer], self.values[layer] = key, value
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:  # beam search
        for store in (self.keys, self.values):
            for layer, tensor in store.items():
                store[layer] = tensor.index_select(0, beam_idx.to(tensor.device))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: RavenConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.Wqkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, config.n_heads, config.head_dim))
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        mask: torch.Tensor | None,
        cache: RecurrentCache | None,
        layer: tuple[Any, ...],
    ) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.Wqkv(x).view(b, t, 3, self.n_heads, self.head_dim).unbind(2)
        q = rotate(q + _wide(self.qk_bias[0]), rope).to(v.dtype).transpose(1, 2)
        k = rotate(k + _wide(self.qk_bias[1]), rope).to(v.dtype).transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, layer)
        if mask is None:  # causal from position 0, or one new position that sees every cached one
            y = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GatedMLP(nn.Module):
    def __init__(self, config: RavenConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class SandwichBlock(nn.Module):
    """x = norm_2(attn(norm_1 x) + x); x = norm_4(mlp(norm_3 x) + x)."""

    def __init__(self, config: RavenConfig) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = GatedMLP(config)
        self.norm_3 = RMSNorm(config.n_embd, config.norm_eps)
        self.norm_4 = RMSNorm(config.n_embd, config.norm_eps)

    def forward(self, x: torch.Tensor, *attention: Any) -> torch.Tensor:
        x = self.norm_2(self.attn(self.norm_1(x), *attention) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


@dataclass
class RavenCausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: RecurrentCache | None = None
    latent_states: torch.Tensor | None = None  # the state after the last core iteration


class RavenPreTrainedModel(PreTrainedModel):
    config_class = RavenConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = False
    _no_split_modules = ["SandwichBlock"]  # noqa: RUF012 (transformers' own class attributes)
    _supports_sdpa = True
    # transformers 5 maps each tied parameter to its source; 4.x lists the tied parameters.
    # (transformers declares the attribute as a bare None, hence the ignore.)
    _tied_weights_keys = (
        {"lm_head.weight": "transformer.wte.weight"}  # type: ignore[assignment]
        if _TRANSFORMERS_MAJOR >= 5
        else ["lm_head.weight"]
    )

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The published initialisation: truncated normal (±3σ), σ = √(2/5d), the two output
        projections of a block σ / √(2 · effective depth); norms 1, qk bias 0."""
        std = self.config.init_std
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, nn.Linear | nn.Embedding):
            nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
        elif isinstance(module, CausalSelfAttention):
            module.qk_bias.zero_()
        elif isinstance(module, SandwichBlock):  # visited after its children
            out = std / math.sqrt(2 * self.config.effective_expected_depth)
            for weight in (module.attn.proj.weight, module.mlp.proj.weight):
                nn.init.trunc_normal_(weight, std=out, a=-3 * out, b=3 * out)


# transformers' two bases declare generation_config differently (its stubs, not this class).
class RavenForCausalLM(RavenPreTrainedModel, GenerationMixin):  # type: ignore[misc]
    transformer: Any  # an nn.ModuleDict in the published layout: attributes typed at runtime only
    freqs_cis: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, config: RavenConfig) -> None:
        super().__init__(config)
        d = config.n_embd
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.padded_vocab_size, d),
                "prelude": nn.ModuleList(
                    SandwichBlock(config) for _ in range(config.n_layers_in_prelude)
                ),
                "adapter": nn.Linear(2 * d, d, bias=False),
                "core_block": nn.ModuleList(
                    SandwichBlock(config) for _ in range(config.n_layers_in_recurrent_block)
                ),
                "coda": nn.ModuleList(
                    SandwichBlock(config) for _ in range(config.n_layers_in_coda)
                ),
                "ln_f": RMSNorm(d, config.norm_eps),
            }
        )
        self.lm_head = nn.Linear(d, config.padded_vocab_size, bias=False)
        table = rope_table(config.head_dim, config.block_size, config.rope_base)
        self.register_buffer("freqs_cis", table, persistent=True)  # stored, as published
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.transformer.wte = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the recurrence keeps keys per iteration: `RecurrentCache`, made in forward

    def _rope(self, start: int, length: int, position_ids: torch.Tensor | None) -> torch.Tensor:
        """The fp32 RoPE table for these positions. Computed once per device rather than read from
        the `freqs_cis` buffer, which a cast of the model (bf16) would round with the weights."""
        cfg = self.config
        table = self.__dict__.get("_rope_fp32")
        if table is None or table.device != self.freqs_cis.device:
            table = rope_table(cfg.head_dim, cfg.block_size, cfg.rope_base).to(
                self.freqs_cis.device
            )
            self.__dict__["_rope_fp32"] = table  # not a buffer: no dtype cast, not saved
        if position_ids is not None:
            return table[0][position_ids]  # (B, T, 1, head_dim/2, 2)
        if start + length > table.shape[1]:
            raise ValueError(
                f"positions up to {start + length} exceed the context of {table.shape[1]} "
                "(block_size)"
            )
        return table[:, start : start + length]

    def initial_state(self, like: torch.Tensor) -> torch.Tensor:
        """s₀ ~ truncated normal (±3σ), σ = √(2/5d), × √d; drawn in fp32 from the global RNG."""
        std = self.config.init_std
        s = torch.empty(like.shape, device=like.device, dtype=torch.float32)
        nn.init.trunc_normal_(s, std=std, a=-3 * std, b=3 * std)
        return (s * math.sqrt(self.config.n_embd)).to(like.dtype)

    def _attention_mask(
        self, attention_mask: torch.Tensor | None, start: int, t: int
    ) -> torch.Tensor | None:
        """Boolean (B|1, 1, t, start + t) mask: causal, padded keys hidden, every position sees
        itself (a padded query row is never empty). None where SDPA's own causal flag (no cache)
        or no mask (one new position) is exact."""
        padded = attention_mask is not None and not bool(attention_mask.all())
        if not padded and (start == 0 or t == 1):
            return None
        device = self.freqs_cis.device
        rows = torch.arange(start, start + t, device=device)[:, None]
        columns = torch.arange(start + t, device=device)[None, :]
        mask = (columns <= rows)[None, None]
        if padded:
            assert attention_mask is not None
            mask = mask & attention_mask[:, None, None, -(start + t) :].bool().to(device)
        return mask | (columns == rows)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: RecurrentCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_steps: int | None = None,
        input_states: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> RavenCausalLMOutput:
        """`num_steps`: core iterations (default: the config's mean_recurrence, or a depth drawn
        as in pretraining when training); `input_states` (B, T, d): the initial latent state."""
        cfg = self.config
        if inputs_embeds is None:
            inputs_embeds = self.transformer.wte(input_ids)
        t = inputs_embeds.shape[1]
        if use_cache and not isinstance(past_key_values, RecurrentCache):
            past_key_values = RecurrentCache()  # also replaces an empty cache that generate made
        cache = past_key_values if isinstance(past_key_values, RecurrentCache) else None
        start = cache.get_seq_length() if cache is not None else 0
        if position_ids is None and attention_mask is not None and not bool(attention_mask.all()):
            # left padding: each row's tokens at positions 0, 1, ... as they would be alone
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
        rope = self._rope(start, t, position_ids)
        mask = self._attention_mask(attention_mask, start, t)

        x = inputs_embeds * math.sqrt(cfg.n_embd)
        for i, block in enumerate(self.transformer.prelude):
            x = block(x, rope, mask, cache, ("prelude", i))
        embedded = x

        steps, with_grad = self._depth(num_steps)
        s = self.initial_state(embedded) if input_states is None else input_states.to(x.dtype)
        for iteration in range(steps):
            with torch.set_grad_enabled(torch.is_grad_enabled() and iteration >= steps - with_grad):
                s = self.transformer.adapter(torch.cat((s, embedded), dim=-1))
                for i, block in enumerate(self.transformer.core_block):
                    s = block(s, rope, mask, cache, ("core", iteration, i))

        x = self.transformer.ln_f(s)
        for i, block in enumerate(self.transformer.coda):
            x = block(x, rope, mask, cache, ("coda", i))
        x = self.transformer.ln_f(x)
        if cache is not None:
            cache.seen_tokens += t
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x)
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].reshape(-1).to(logits.device)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), shifted)
        return RavenCausalLMOutput(loss=loss, logits=logits, past_key_values=cache, latent_states=s)

    def _depth(self, num_steps: int | torch.Tensor | None) -> tuple[int, int]:
        """(iterations, of which the last ones with gradients). Training without `num_steps`
        draws the depth as pretraining did: r = Poisson(λ) + 1, λ ~ LogNormal(ln r̄ − σ²/2, σ)."""
        cfg = self.config
        backprop = cfg.mean_backprop_depth
        if num_steps is not None:
            steps = int(num_steps)
        elif self.training:
            sigma = 0.5
            rate = torch.empty(1).log_normal_(math.log(cfg.mean_recurrence) - sigma**2 / 2, sigma)
            steps = int(torch.poisson(rate)) + 1
        else:
            steps = cfg.mean_recurrence
        if steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {steps}")
        return steps, min(backprop, steps)

    # generate() passes cache_position by keyword (dropped below) and gets back the cache that
    # forward made: a RecurrentCache, not one of transformers' Cache classes.
    def prepare_inputs_for_generation(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        past_key_values: RecurrentCache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Only the tokens the cache has not seen; the rest of generate's arguments (`num_steps`
        among them) go to forward unchanged."""
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        inputs: dict[str, Any] = {
            "past_key_values": past_key_values,
            "attention_mask": attention_mask,
        }
        if inputs_embeds is not None and seen == 0:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids[:, seen:]
        for name in ("cache_position", "position_ids", "token_type_ids"):
            kwargs.pop(name, None)  # positions come from the cache; no segment ids
        return {**kwargs, **inputs}

    def _reorder_cache(self, past_key_values: RecurrentCache, beam_idx: torch.Tensor) -> Any:
        past_key_values.reorder_cache(beam_idx)
        return past_key_values

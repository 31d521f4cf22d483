"""RavenConfig: the published Huginn configuration (`model_type` huginn_raven) for transformers.

Shipped into every export directory by `python -m trainer export` (rlm-ops, trainer/hub/) and
loaded from there with `AutoConfig.from_pretrained(export, trust_remote_code=True)`. Field names,
aliases (`num_attention_heads`, `hidden_size`, `num_hidden_layers`) and defaults are those of the
published model's config, so the Hub's config.json and an export's config.json load alike.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig


class RavenConfig(PretrainedConfig):
    model_type = "huginn_raven"
    keys_to_ignore_at_inference = ["past_key_values", "latent_states"]  # noqa: RUF012
    attribute_map = {  # noqa: RUF012 (transformers reads these class attributes)
        "num_attention_heads": "n_heads",
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layers",
    }

    def __init__(
        self,
        n_embd: int = 5280,
        n_heads: int = 55,
        n_layers: int | None = None,
        n_layers_in_prelude: int = 2,
        n_layers_in_recurrent_block: int = 4,
        n_layers_in_coda: int = 2,
        intermediate_size: int = 17920,
        vocab_size: int = 65536,
        block_size: int = 4096,
        rope_base: float = 50_000.0,
        norm_eps: float = 1e-6,
        mean_recurrence: int = 32,
        mean_backprop_depth: int = 8,
        qk_bias: bool = True,
        bias: bool = False,
        tie_embeddings: bool = True,
        **kwargs: Any,
    ) -> None:
        self.n_embd = n_embd
        self.n_heads = n_heads
        self.n_layers_in_prelude = n_layers_in_prelude
        self.n_layers_in_recurrent_block = n_layers_in_recurrent_block
        self.n_layers_in_coda = n_layers_in_coda
        self.n_layers = (
            n_layers or n_layers_in_prelude + n_layers_in_recurrent_block + n_layers_in_coda
        )
        self.intermediate_size = intermediate_size
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.rope_base = float(rope_base)
        self.norm_eps = float(norm_eps)
        self.mean_recurrence = mean_recurrence
        self.mean_backprop_depth = mean_backprop_depth
        self.qk_bias = qk_bias
        self.bias = bias
        self.tie_embeddings = tie_embeddings
        # Derived values the published config.json also carries; recomputed, never taken as given.
        for derived in ("head_dim", "effective_expected_depth", "init_values"):
            kwargs.pop(derived, None)
        self.padded_vocab_size = kwargs.pop("padded_vocab_size", vocab_size)
        kv_heads = kwargs.pop("num_key_value_heads", None)
        kwargs.setdefault("tie_word_embeddings", tie_embeddings)
        super().__init__(**kwargs)  # may set n_heads through its alias `num_attention_heads`
        self.num_key_value_heads = kv_heads or self.n_heads
        if self.num_key_value_heads != self.n_heads:
            raise ValueError(
                f"num_key_value_heads={kv_heads} != n_heads={self.n_heads}: Huginn's attention has "
                "as many key/value heads as query heads"
            )
        self.head_dim = self.n_embd // self.n_heads
        core = self.n_layers_in_recurrent_block * self.mean_recurrence
        self.effective_expected_depth = self.n_layers_in_prelude + core + self.n_layers_in_coda
        std = math.sqrt(2 / (5 * self.n_embd))
        self.init_values = {
            "std": std,
            "out_proj": std / math.sqrt(2 * self.effective_expected_depth),
            "embedding": std,
            "embed_scale": math.sqrt(self.n_embd),
        }

    @property
    def init_std(self) -> float:
        return self.init_values["std"]

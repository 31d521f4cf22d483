"""The published Hugging Face layout of Huginn (`RavenForCausalLM`, model_type `huginn_raven`).

Learnt from the published model's own files (seal-rg/recurrent-pretraining:
recpre/raven_modeling_minimal.py, recpre/raven_config_minimal.py/.json); no code is shared.

    config.json                     RavenConfig fields (`n_embd`, `n_layers_in_prelude`, ...)
    model.safetensors               one file, or
    model-0000x-of-0000y.safetensors + model.safetensors.index.json (`weight_map`)

Parameter names, ours → published:

    embedding.weight                transformer.wte.weight (tied: lm_head.weight is not stored)
    prelude.i / core.i / coda.i     transformer.prelude.i / transformer.core_block.i / transformer.coda.i
      .n1 .n2 .n3 .n4               .norm_1 .norm_2 .norm_3 .norm_4
      .attn.qkv .attn.qk_bias       .attn.Wqkv .attn.qk_bias
      .attn.proj                    .attn.proj
      .mlp.gate_up .mlp.proj        .mlp.fc .mlp.proj
    adapter.weight                  transformer.adapter.weight
    ln_f.weight                     transformer.ln_f.weight
    (RoPE tables, recomputed)       freqs_cis (1, block_size, 1, head_dim/2, 2) fp32 cos/sin
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainer.errors import UserError
from trainer.model import ModelConfig, RecurrentLM, rope_cache

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MODEL_TYPE = "huginn_raven"
ARCHITECTURE = "RavenForCausalLM"
ROPE_NAME = "freqs_cis"
HEAD_NAME = "lm_head.weight"

_SECTIONS = {"prelude": "transformer.prelude", "core": "transformer.core_block"}
_SECTIONS["coda"] = "transformer.coda"
_BLOCK_PARTS = {
    "n1.weight": "norm_1.weight",
    "n2.weight": "norm_2.weight",
    "n3.weight": "norm_3.weight",
    "n4.weight": "norm_4.weight",
    "attn.qkv.weight": "attn.Wqkv.weight",
    "attn.qk_bias": "attn.qk_bias",
    "attn.proj.weight": "attn.proj.weight",
    "mlp.gate_up.weight": "mlp.fc.weight",
    "mlp.proj.weight": "mlp.proj.weight",
}
_TOP = {
    "embedding.weight": "transformer.wte.weight",
    "adapter.weight": "transformer.adapter.weight",
    "ln_f.weight": "transformer.ln_f.weight",
}

# RavenConfig fields with the only values this architecture has; anything else is another model.
_FIXED: dict[str, Any] = {
    "tie_embeddings": True,
    "bias": False,
    "qk_bias": True,
    "architecture_class_name": "RecurrentGPT",
    "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "state_init": "like-init",
    "injection_type": "linear",
    "test_time_noise": 0,  # noise added to the state each iteration: not part of this model
}
# RavenConfig fields that describe training or initialisation, not the network: kept on export,
# accepted (and ignored) on import.
_DESCRIPTIVE: dict[str, Any] = {
    "padding_multiple": 4096,
    "init_strategy": "takase",
    "init_orthogonal": False,
    "sampling_scheme": "poisson-lognormal-filling",
    "activation_checkpoint_impl": "per-iteration",
    "torch_dtype": "float32",
    "transformers_version": "4.47.1",
    "test_time_noise_type": "fixed",
}
# Written by transformers' PretrainedConfig itself (and derived RavenConfig attributes).
_HF_GENERIC = {
    "architectures", "model_type", "auto_map", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "pad_token_id", "_name_or_path", "use_cache", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "is_encoder_decoder",
    "num_key_value_heads", "num_attention_heads", "head_dim", "effective_expected_depth",
    "init_values", "padded_vocab_size", "n_layers", "vocab_size", "_attn_implementation",
}  # fmt: skip
# RavenConfig field → ModelConfig field.
_SHAPE = {
    "n_embd": "d_model",
    "n_heads": "n_heads",
    "intermediate_size": "mlp_hidden",
    "n_layers_in_prelude": "n_prelude",
    "n_layers_in_recurrent_block": "n_core",
    "n_layers_in_coda": "n_coda",
    "block_size": "max_seq_len",
    "rope_base": "rope_base",
    "mean_recurrence": "mean_recurrence",
    "mean_backprop_depth": "backprop_depth",
    "norm_eps": "norm_eps",
}
KNOWN_FIELDS = set(_FIXED) | set(_DESCRIPTIVE) | _HF_GENERIC | set(_SHAPE)


def hf_name(name: str) -> str:
    """The published name of one of our parameter names."""
    if name in _TOP:
        return _TOP[name]
    section, index, part = name.split(".", 2)
    return f"{_SECTIONS[section]}.{index}.{_BLOCK_PARTS[part]}"


def to_hf_config(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
    """config.json of the published layout for `cfg`."""
    depth = cfg.n_prelude + cfg.n_coda + cfg.n_core * cfg.mean_recurrence
    std = math.sqrt(2 / (5 * cfg.d_model))
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "n_embd": cfg.d_model,
        "n_heads": cfg.n_heads,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.head_dim,
        "n_layers": cfg.n_prelude + cfg.n_core + cfg.n_coda,
        "n_layers_in_prelude": cfg.n_prelude,
        "n_layers_in_recurrent_block": cfg.n_core,
        "n_layers_in_coda": cfg.n_coda,
        "intermediate_size": cfg.mlp_hidden,
        "vocab_size": cfg.vocab_size,
        "padded_vocab_size": cfg.vocab_size,
        "block_size": cfg.max_seq_len,
        "rope_base": cfg.rope_base,
        "norm_eps": cfg.norm_eps,
        "mean_recurrence": cfg.mean_recurrence,
        "mean_backprop_depth": cfg.backprop_depth,
        "effective_expected_depth": depth,
        "init_values": {
            "std": std,
            "out_proj": std / math.sqrt(2 * depth),
            "embedding": std,
            "embed_scale": math.sqrt(cfg.d_model),
        },
        "tie_word_embeddings": True,
        **_FIXED,
        **_DESCRIPTIVE,
        **extra,
    }


def from_hf_config(values: dict[str, Any], source: Path) -> ModelConfig:
    """Our ModelConfig for a published config.json; any field we do not know, or a value of a
    fixed field that is not this architecture's, is a one-line UserError naming it."""
    unknown = sorted(set(values) - KNOWN_FIELDS)
    if unknown:
        raise UserError(
            f"{source}: unknown config field {unknown[0]!r} (the importer knows the published "
            "Huginn RavenConfig fields); remove it or convert the model another way"
        )
    if values.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise UserError(f"{source}: model_type {values['model_type']!r} is not {MODEL_TYPE!r}")
    for name, wanted in _FIXED.items():
        if name in values and values[name] != wanted:
            raise UserError(f"{source}: {name}={values[name]!r} is not supported (only {wanted!r})")
    missing = sorted(set(_SHAPE) - set(values))
    if missing:
        raise UserError(f"{source}: config field {missing[0]!r} is missing")
    heads = values["n_heads"]
    for name in ("num_key_value_heads", "num_attention_heads"):
        if values.get(name, heads) != heads:
            raise UserError(f"{source}: {name}={values[name]} must equal n_heads={heads}")
    vocab = values.get("padded_vocab_size", values.get("vocab_size"))
    if vocab is None:
        raise UserError(f"{source}: config field 'vocab_size' is missing")
    layers = values["n_layers_in_prelude"] + values["n_layers_in_recurrent_block"]
    layers += values["n_layers_in_coda"]
    if values.get("n_layers", layers) != layers:
        raise UserError(
            f"{source}: n_layers={values['n_layers']} is not prelude + recurrent block + coda "
            f"= {layers}"
        )
    fields = {ours: values[theirs] for theirs, ours in _SHAPE.items()}
    fields["rope_base"] = float(fields["rope_base"])
    fields["norm_eps"] = float(fields["norm_eps"])
    try:
        return ModelConfig(vocab_size=vocab, **fields)
    except UserError as exc:
        raise UserError(f"{source}: {exc}") from None


def rope_table(cfg: ModelConfig) -> torch.Tensor:
    """The published `freqs_cis` buffer: cos and sin stacked last, (1, T, 1, head_dim/2, 2)."""
    cos, sin = rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
    return torch.stack((cos, sin), dim=-1)[None, :, None]


def save_hf(
    model: RecurrentLM,
    out_dir: Path,
    max_shard_bytes: int = 5 << 30,
    dtype: torch.dtype | None = None,
    **config_extra: Any,
) -> None:
    """Write config.json and the weights (sharded above `max_shard_bytes`) into `out_dir`."""
    tensors = {
        hf_name(n): (t.to(dtype) if dtype else t).detach().contiguous()
        for n, t in model.state_dict().items()
    }
    tensors[ROPE_NAME] = rope_table(model.cfg)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / SINGLE_FILE), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out_dir / file), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    stored = dtype or next(iter(model.state_dict().values())).dtype
    torch_dtype = str(stored).removeprefix("torch.")
    config = to_hf_config(model.cfg, torch_dtype=torch_dtype, **config_extra)
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def is_hf_dir(path: Path) -> bool:
    return (path / CONFIG_NAME).is_file() and (
        (path / SINGLE_FILE).is_file() or (path / INDEX_NAME).is_file()
    )


def _weight_files(path: Path) -> list[Path]:
    if (path / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((path / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{path / INDEX_NAME} has no weight_map") from None
        names = sorted(set(weight_map.values()))
        if any(not re.fullmatch(r"[\w.-]+\.safetensors", n) for n in names):
            raise UserError(f"{path / INDEX_NAME} names files outside {path}")
        files = [path / n for n in names]
    else:
        files = [path / SINGLE_FILE]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise UserError(f"{path}: weight file {absent[0]} is missing")
    return files


def load_hf(path: Path | str) -> RecurrentLM:
    """The RecurrentLM (fp32, CPU, eval mode) of a directory in the published layout."""
    path = Path(path)
    try:
        values = json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path / CONFIG_NAME} is unreadable ({exc.__class__.__name__})") from None
    if not isinstance(values, dict):
        raise UserError(f"{path / CONFIG_NAME} is not a JSON object")
    cfg = from_hf_config(values, path / CONFIG_NAME)
    with torch.device("meta"):
        model = RecurrentLM(cfg)
    ours = {hf_name(n): n for n in model.state_dict()}
    loaded: dict[str, torch.Tensor] = {}
    head = None
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name == ROPE_NAME:
                    continue  # recomputed from rope_base and block_size
                if name == HEAD_NAME:
                    head = f.get_tensor(name)
                    continue
                if name not in ours:
                    raise UserError(f"{file}: unexpected tensor {name!r}")
                loaded[ours[name]] = f.get_tensor(name).float()
    missing = sorted(set(ours.values()) - set(loaded))
    if missing:
        raise UserError(f"{path}: tensor {hf_name(missing[0])!r} is missing")
    if head is not None and not torch.equal(head.float(), loaded["embedding.weight"]):
        raise UserError(f"{path}: lm_head.weight differs from the tied transformer.wte.weight")
    for name, tensor in loaded.items():
        wanted = model.get_parameter(name).shape
        if tensor.shape != wanted:
            raise UserError(
                f"{path}: {hf_name(name)} has shape {tuple(tensor.shape)}, config.json implies "
                f"{tuple(wanted)}"
            )
    model.load_state_dict(loaded, assign=True)  # the meta parameters become the loaded tensors
    model.reset_rope()
    return model.eval()

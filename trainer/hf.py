"""The published Hugging Face layout of Huginn (`RavenForCausalLM`, model_type `huginn_raven`).

Learnt from the published model's own files (seal-rg/recurrent-pretraining:
recpre/raven_modeling_minimal.py, recpre/raven_config_minimal.py/.json); no code is shared.

    config.json                     RavenConfig fields (`n_embd`, `n_layers_in_prelude`, ...),
                                    `auto_map` to the modelling code below, no tie_word_embeddings
    model.safetensors               one file, or
    model-0000x-of-0000y.safetensors + model.safetensors.index.json (`weight_map`)
    configuration_raven.py,         this project's transformers classes (trainer/hub/), for
    modeling_raven.py               AutoConfig / AutoModelForCausalLM with trust_remote_code
    tokenizer_config.json,          for AutoTokenizer and generate (`token_files`; trainer/export.py
    generation_config.json          copies tokenizer.json and what came with it)

Import reads config.json files written by `export`, by transformers 4.4x-5.x and by the published
code (`from_hf_config`: its aliases and defaults; generic transformers fields noted, unknown or
architecture-changing ones refused in one line).

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
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from trainer.errors import UserError
from trainer.hub import MODELLING_FILES
from trainer.model import ModelConfig, RecurrentLM, rope_cache

CONFIG_NAME = "config.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MODEL_TYPE = "huginn_raven"
ARCHITECTURE = "RavenForCausalLM"
ROPE_NAME = "freqs_cis"
# This project's modelling code (trainer/hub/), shipped into every export.
AUTO_MAP = {
    "AutoConfig": "configuration_raven.RavenConfig",
    "AutoModelForCausalLM": "modeling_raven.RavenForCausalLM",
}
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
    "test_time_noise_type": "fixed",
}
# Fields of the published config that say nothing the weights and the fields above do not.
_REFERENCE_METADATA = {
    "name", "hf_config", "effective_expected_depth", "init_values", "padded_vocab_size",
}  # fmt: skip
# RavenConfig field → ModelConfig field, with the published config class's default where a
# config.json leaves the field out (its raven_config_minimal.json has no rope_base, no n_heads).
_SHAPE: dict[str, tuple[str, Any]] = {
    "n_embd": ("d_model", 5280),
    "n_heads": ("n_heads", 55),
    "intermediate_size": ("mlp_hidden", 17920),
    "n_layers_in_prelude": ("n_prelude", 2),
    "n_layers_in_recurrent_block": ("n_core", 4),
    "n_layers_in_coda": ("n_coda", 2),
    "block_size": ("max_seq_len", 4096),
    "rope_base": ("rope_base", 50_000.0),
    "mean_recurrence": ("mean_recurrence", 32),
    "mean_backprop_depth": ("backprop_depth", 8),
    "norm_eps": ("norm_eps", 1e-6),
    "vocab_size": ("vocab_size", 65536),
}
# The published config class's aliases (its `attribute_map`) and transformers' generic names.
_ALIASES = {
    "num_attention_heads": "n_heads",
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layers",
    "rope_theta": "rope_base",
    "max_position_embeddings": "block_size",
    "rms_norm_eps": "norm_eps",
}
# Written by transformers' PretrainedConfig itself (every field of `PretrainedConfig().to_dict()`
# in transformers 4.44, 4.57 and 5.23, and what save_pretrained adds), none of which changes the
# network: accepted, and named in a note when it carries more than bookkeeping.
_HF_BOOKKEEPING = {
    "architectures", "model_type", "auto_map", "transformers_version", "_name_or_path",
    "torch_dtype", "dtype", "_attn_implementation_autoset", "_commit_hash", "use_cache",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "chunk_size_feed_forward", "tf_legacy_loss", "pruned_heads",
    "id2label", "label2id", "problem_type", "finetuning_task", "prefix", "task_specific_params",
    # special tokens: tokenizer_config.json and generation_config.json own them
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
}  # fmt: skip
_HF_IGNORED = {
    # generation defaults of transformers < 4.41: generation_config.json owns them now
    "tokenizer_class", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "bad_words_ids",
    "encoder_no_repeat_ngram_size", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "attn_implementation", "_attn_implementation", "initializer_range",
}  # fmt: skip
# Generic fields that would change the network: accepted only with the value that does not.
_NEUTRAL: dict[str, Any] = {
    "rope_scaling": None,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "quantization_config": None,
}
KNOWN_FIELDS = (
    set(_FIXED) | set(_DESCRIPTIVE) | _REFERENCE_METADATA | set(_SHAPE) | set(_ALIASES)
    | _HF_BOOKKEEPING | _HF_IGNORED | set(_NEUTRAL)
    | {"n_layers", "num_key_value_heads", "head_dim", "rope_parameters"}
)  # fmt: skip


def hf_name(name: str) -> str:
    """The published name of one of our parameter names."""
    if name in _TOP:
        return _TOP[name]
    section, index, part = name.split(".", 2)
    return f"{_SECTIONS[section]}.{index}.{_BLOCK_PARTS[part]}"


def to_hf_config(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
    """config.json of the published layout for `cfg`, loadable by this project's RavenConfig
    (auto_map) and by the published one, which passes `tie_word_embeddings` to transformers
    itself: that key is left out (`tie_embeddings` says it)."""
    depth = cfg.n_prelude + cfg.n_coda + cfg.n_core * cfg.mean_recurrence
    std = math.sqrt(2 / (5 * cfg.d_model))
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "auto_map": AUTO_MAP,
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
        **_FIXED,
        **_DESCRIPTIVE,
        **extra,
    }


def _merge_aliases(values: dict[str, Any], source: Path) -> dict[str, Any]:
    """`values` with every alias renamed to the published field; both given and different is
    an error."""
    values = dict(values)
    rope = values.pop("rope_parameters", None)
    if rope is not None:  # transformers 5's form: {"rope_type": "default", "rope_theta": ...}
        if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
            raise UserError(
                f"{source}: rope_parameters={rope!r} is not supported (only plain RoPE, "
                'rope_type "default")'
            )
        theta = rope.get("rope_theta")
        if theta is not None and values.setdefault("rope_theta", theta) != theta:
            raise UserError(f"{source}: rope_parameters contradicts rope_theta")
    merged = {k: v for k, v in values.items() if k not in _ALIASES}
    for alias, field in _ALIASES.items():
        if alias not in values:
            continue
        if field in values and values[field] != values[alias]:
            raise UserError(
                f"{source}: {alias}={values[alias]!r} contradicts {field}={values[field]!r}"
            )
        merged[field] = values[alias]
    return merged


def from_hf_config(
    values: dict[str, Any], source: Path, notes: list[str] | None = None
) -> ModelConfig:
    """Our ModelConfig for a config.json written by the published code, by transformers 4.4x-5.x
    (this project's RavenConfig) or by `export`. A field we do not know, or a value that makes
    another architecture, is a one-line UserError naming it; generic transformers fields that we
    ignore and published defaults that we apply are described in `notes`."""
    unknown = sorted(set(values) - KNOWN_FIELDS)
    if unknown:
        raise UserError(
            f"{source}: unknown config field {unknown[0]!r} (the importer knows the published "
            "Huginn RavenConfig fields and transformers' generic ones); remove it if it does not "
            "change the model, or convert the model another way"
        )
    if values.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise UserError(f"{source}: model_type {values['model_type']!r} is not {MODEL_TYPE!r}")
    for name, wanted in (_FIXED | _NEUTRAL).items():
        if name in values and values[name] != wanted:
            why = (
                " (quantized weights: save them unquantized first)"
                if name == "quantization_config"
                else ""
            )
            raise UserError(
                f"{source}: {name}={values[name]!r} is not supported (only {wanted!r}){why}"
            )
    values = _merge_aliases(values, source)
    heads = values.get("n_heads", _SHAPE["n_heads"][1])
    if values.get("num_key_value_heads", heads) != heads:
        raise UserError(
            f"{source}: num_key_value_heads={values['num_key_value_heads']} must equal "
            f"n_heads={heads}"
        )
    defaulted = {k: d for k, (_, d) in _SHAPE.items() if k not in values}
    fields = {ours: values.get(theirs, default) for theirs, (ours, default) in _SHAPE.items()}
    fields["vocab_size"] = values.get("padded_vocab_size", fields["vocab_size"])
    if "padded_vocab_size" in values:
        defaulted.pop("vocab_size", None)
    layers = fields["n_prelude"] + fields["n_core"] + fields["n_coda"]
    if values.get("n_layers", layers) != layers:
        raise UserError(
            f"{source}: n_layers={values['n_layers']} is not prelude + recurrent block + coda "
            f"= {layers}"
        )
    if "head_dim" in values and values["head_dim"] * heads != fields["d_model"]:
        raise UserError(
            f"{source}: head_dim={values['head_dim']} is not n_embd / n_heads = "
            f"{fields['d_model']} / {heads}"
        )
    for name in ("rope_base", "norm_eps"):
        if isinstance(fields[name], int | float) and not isinstance(fields[name], bool):
            fields[name] = float(fields[name])
    try:
        cfg = ModelConfig(**fields)
    except UserError as exc:
        raise UserError(f"{source}: {exc}") from None
    if notes is not None:
        if defaulted:
            given = ", ".join(f"{k}={v}" for k, v in defaulted.items())
            notes.append(f"{source}: not given, the published defaults apply: {given}")
        ignored = sorted(set(values) & _HF_IGNORED)
        if ignored:
            notes.append(
                f"{source}: ignored {len(ignored)} transformers field(s) that do not change the "
                f"weights ({', '.join(ignored)}); generation defaults belong in "
                "generation_config.json"
            )
    return cfg


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
    """Write config.json, the weights (sharded above `max_shard_bytes`) and the modelling code
    that config.json's `auto_map` names into `out_dir`."""
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
    for source in MODELLING_FILES:  # what `auto_map` names, for trust_remote_code
        shutil.copyfile(source, out_dir / source.name)


def token_files(tokenizer_json: Path, block_size: int) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json and generation_config.json for a tokenizer.json of the trainer's
    (`prepare`): its end-of-text token separates documents, so it is also where generation stops
    and what pads a batch. `AutoTokenizer` then loads a fast tokenizer from tokenizer.json."""
    from tokenizers import Tokenizer

    from trainer.data import EOT_TOKEN

    try:
        eot_id = Tokenizer.from_file(str(tokenizer_json)).token_to_id(EOT_TOKEN)
    except Exception:  # tokenizers raises a bare Exception on a malformed file
        raise UserError(
            f"{tokenizer_json} is not a valid tokenizer.json; copy the dataset's tokenizer.json "
            "there or remove it"
        ) from None
    tokenizer: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_input_names": ["input_ids", "attention_mask"],  # no token_type_ids
        "model_max_length": block_size,
        "clean_up_tokenization_spaces": False,
    }
    generation: dict[str, Any] = {"do_sample": False}
    if eot_id is not None:
        tokenizer |= {"bos_token": EOT_TOKEN, "eos_token": EOT_TOKEN, "pad_token": EOT_TOKEN}
        generation |= {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id}
    return {TOKENIZER_CONFIG_NAME: tokenizer, GENERATION_CONFIG_NAME: generation}


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


def _read_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of one safetensors file; a damaged file is a one-line UserError naming it."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise UserError(
            f"{file} is not a readable safetensors file ({reason}); it may be truncated: "
            "download or export it again"
        ) from None


def load_hf(path: Path | str, notes: list[str] | None = None) -> RecurrentLM:
    """The RecurrentLM (fp32, CPU, eval mode) of a directory in the published layout; what the
    import ignored or assumed is appended to `notes`."""
    path = Path(path)
    try:
        values = json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path / CONFIG_NAME} is unreadable ({exc.__class__.__name__})") from None
    if not isinstance(values, dict):
        raise UserError(f"{path / CONFIG_NAME} is not a JSON object")
    cfg = from_hf_config(values, path / CONFIG_NAME, notes)
    with torch.device("meta"):
        model = RecurrentLM(cfg)
    ours = {hf_name(n): n for n in model.state_dict()}
    loaded: dict[str, torch.Tensor] = {}
    stored_dtypes: set[torch.dtype] = set()
    head = None
    for file in _weight_files(path):
        for name, tensor in _read_tensors(file):
            if name == ROPE_NAME:
                continue  # recomputed from rope_base and block_size
            if name == HEAD_NAME:
                head = tensor
                continue
            if name not in ours:
                raise UserError(f"{file}: unexpected tensor {name!r}")
            stored_dtypes.add(tensor.dtype)
            loaded[ours[name]] = tensor.float()
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
    if notes is not None and stored_dtypes - {torch.float32}:
        kinds = ", ".join(sorted(str(d).removeprefix("torch.") for d in stored_dtypes))
        notes.append(f"{path}: weights stored as {kinds} are loaded as float32")
    model.load_state_dict(loaded, assign=True)  # the meta parameters become the loaded tensors
    model.reset_rope()
    return model.eval()

"""`rlmctl plan`: how many GPUs a model needs, from a memory estimate per GPU.

Static memory with mixed precision and AdamW is 16 bytes per parameter (fp32 weights, fp32
gradients, two fp32 moments). Unsharded (DDP) every GPU holds all of it; sharded (FSDP/ZeRO-3)
each of G GPUs holds 1/G. Activations (bf16) are counted per block that keeps them for backward:
prelude + coda + the last `backprop_depth` core iterations (earlier iterations run without
gradients), with flash attention (no s² score matrix). Activation checkpointing keeps only each
block's input and recomputes one block at a time. The rule of thumb `params × 4 B / GPU memory`
(fp32 weights alone) is shown beside it because it is what people quote, and it underestimates by
4× before activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from rlmctl import layouts
from rlmctl.errors import RlmctlError
from rlmctl.records import MemoryEstimate, Plan
from runcontract.config import Config, ModelConfig, model_config
from runcontract.errors import UserError

BYTES_STATIC_PER_PARAM = 16  # fp32 weights + fp32 grads + AdamW m and v
BF16 = 2
USABLE_FRACTION = 0.9  # allocator fragmentation, NCCL buffers, CUDA context
RESERVED_GIB = 2.0


def shape(preset: str | None, params: float | None, seq_len: int | None) -> dict[str, Any]:
    """The model's shape from a preset or a parameter count (a Huginn-like shape is assumed
    for activations)."""
    if preset is not None:
        try:
            cfg = model_config(preset)
        except UserError as error:
            raise RlmctlError(str(error)) from None
        return model_shape(cfg, preset, seq_len)
    if params is None:
        raise RlmctlError("give --model PRESET or --params N (e.g. --params 3.5e9)")
    if not math.isfinite(params) or params < 1:
        raise RlmctlError(f"--params {params} is not a parameter count; give e.g. --params 3.5e9")
    # Scale Huginn-3.5B's shape: d grows with sqrt(params) at fixed depth.
    d_model = int(5280 * math.sqrt(params / 3.5e9))
    return {
        "name": f"{params:.3g} params",
        "params": int(params),
        "d_model": d_model,
        "mlp_hidden": int(d_model * 17920 / 5280),
        "vocab": 65536,
        "stored_blocks": 2 + 2 + 4 * 8,
        "seq_len": seq_len or 4096,
    }


def model_shape(cfg: ModelConfig, name: str, seq_len: int | None = None) -> dict[str, Any]:
    """What the estimate needs of a model config (the sequence length: its max_seq_len)."""
    return {
        "name": name,
        "params": param_count(cfg),
        "d_model": cfg.d_model,
        "mlp_hidden": cfg.mlp_hidden,
        "vocab": cfg.vocab_size,
        "stored_blocks": cfg.n_prelude + cfg.n_coda + cfg.n_core * cfg.backprop_depth,
        "n_core": cfg.n_core,
        "seq_len": seq_len or cfg.max_seq_len,
    }


def param_count(cfg: Any) -> int:
    """Parameters of a RecurrentLM config without building it (tied embedding counted once)."""
    d, h = cfg.d_model, cfg.mlp_hidden
    block = 4 * d * d + 3 * d * h + 6 * d  # attention, SwiGLU, four sandwich norms, qk bias
    blocks = cfg.n_prelude + cfg.n_core + cfg.n_coda
    return cfg.vocab_size * d + blocks * block + 2 * d * d + d  # + adapter, one ln_f


def activation_bytes(model: dict[str, Any], micro_batch: int, checkpointing: bool) -> int:
    tokens = micro_batch * model["seq_len"]
    d, h = model["d_model"], model["mlp_hidden"]
    # per block: attention inputs/Q/K/V/output (≈11 d), four norm inputs (8 d), SwiGLU (2 d + 8 h)
    per_block = tokens * (21 * d + 8 * h)
    logits = tokens * model["vocab"] * (BF16 + 4)  # bf16 logits + fp32 for the loss
    if checkpointing:
        return model["stored_blocks"] * tokens * d * BF16 + per_block + logits
    return model["stored_blocks"] * per_block + logits


def usable_bytes(gpu_mem_gib: float) -> float:
    return gpu_mem_gib * 2**30 * USABLE_FRACTION - RESERVED_GIB * 2**30


def estimate(
    preset: str | None,
    params: float | None,
    gpu_mem_gib: float,
    seq_len: int | None,
    micro_batch: int,
    gpus: int = 8,
    gpus_per_node: int = 8,
) -> Plan:
    if not math.isfinite(gpu_mem_gib):
        raise RlmctlError(f"--gpu-mem {gpu_mem_gib} is not a memory size; give GiB, e.g. 80")
    if gpus < 1 or gpus_per_node < 1:
        raise RlmctlError("--gpus and --gpus-per-node must be >= 1")
    if gpu_mem_gib <= RESERVED_GIB:
        raise RlmctlError(f"--gpu-mem {gpu_mem_gib} GiB is too small (need > {RESERVED_GIB})")
    if micro_batch < 1:
        raise RlmctlError(f"--micro-batch {micro_batch} must be >= 1")
    if seq_len is not None and seq_len < 1:
        raise RlmctlError(f"--seq-len {seq_len} must be a positive token count, e.g. 4096")
    model = shape(preset, params, seq_len)
    usable = usable_bytes(gpu_mem_gib)
    static = model["params"] * BYTES_STATIC_PER_PARAM
    rows = []
    for checkpointing in (False, True):
        act = activation_bytes(model, micro_batch, checkpointing)
        act_one = activation_bytes(model, 1, checkpointing)
        unsharded_fits = static + act <= usable
        room = usable - act
        min_gpus = math.ceil(static / room) if room > 0 else None
        micro = None
        if min_gpus:
            free = usable - static / min_gpus
            micro = max(0, int(free // act_one)) if act_one else None
        rows.append(
            MemoryEstimate(
                activation_checkpointing=checkpointing,
                activations_gib=act / 2**30,
                unsharded_per_gpu_gib=(static + act) / 2**30,
                unsharded_fits=unsharded_fits,
                min_gpus_sharded=min_gpus,
                max_micro_batch_at_min_gpus=micro,
                layouts=layouts.choose(model, act, gpus, gpus_per_node, usable),
            )
        )
    return Plan(
        model=model["name"],
        params=model["params"],
        seq_len=model["seq_len"],
        micro_batch=micro_batch,
        gpu_mem_gib=gpu_mem_gib,
        usable_gib=usable / 2**30,
        static_gib=static / 2**30,
        rule_of_thumb_gpus=math.ceil(model["params"] * 4 / (gpu_mem_gib * 2**30)),
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        estimates=rows,
    )


@dataclass(frozen=True)
class Fit:
    """A config's memory per GPU in its own layout, against what the GPUs have."""

    layout: str
    per_gpu_gib: float
    usable_gib: float
    problem: str | None  # why it cannot fit and which layout would; None when it fits


def layout_of(cfg: Config, gpus: int, gpus_per_node: int) -> str:
    """The rlmctl/layouts.py name of the config's parallel section on `gpus` GPUs."""
    if cfg.parallel.strategy == "ddp":
        return "ddp"
    if cfg.parallel.offload:
        return "offload"
    return "hsdp" if cfg.parallel.strategy == "hsdp" and gpus > gpus_per_node else "fsdp"


SETTINGS = {
    "ddp": "parallel.strategy=ddp",
    "hsdp": "parallel.strategy=hsdp",
    "fsdp": "parallel.strategy=fsdp",
    "offload": "parallel.strategy=fsdp parallel.offload=true",
}


def config_fit(cfg: Config, gpus: int, gpus_per_node: int, gpu_mem_gib: float) -> Fit:
    """The estimate of `estimate` for a trainer config as it would run on `gpus` GPUs of
    `gpu_mem_gib` each (its model, micro-batch, activation checkpointing and layout; the
    sequence length is model.max_seq_len), and when it does not fit, the cheapest layout that
    does: the same activation checkpointing first, then with it on."""
    model = model_shape(cfg.model, cfg.preset)
    usable = usable_bytes(gpu_mem_gib)
    micro, checkpointing = cfg.train.micro_batch, cfg.model.activation_checkpointing
    mine = layout_of(cfg, gpus, gpus_per_node)
    need = layouts.per_gpu(
        model, activation_bytes(model, micro, checkpointing), gpus, gpus_per_node
    )
    fit = Fit(mine, need[mine] / 2**30, usable / 2**30, None)
    if need[mine] <= usable:
        return fit
    what = (
        f"{SETTINGS[mine]}, train.micro_batch={micro}, model.activation_checkpointing="
        f"{str(checkpointing).lower()}"
    )
    said = (
        f"the memory estimate of model {model['name']} with {what} is {fit.per_gpu_gib:.1f} GiB "
        f"per GPU, more than the {fit.usable_gib:.1f} GiB usable of {gpu_mem_gib:g} GiB "
        "(rlm_gpu_memory_gib)"
    )
    for with_ac in sorted({checkpointing, True}):
        act = activation_bytes(model, micro, with_ac)
        choice = layouts.choose(model, act, gpus, gpus_per_node, usable)
        if choice.pick is not None:
            fix = SETTINGS[choice.pick]
            if with_ac and not checkpointing:
                fix += " model.activation_checkpointing=true"
            size = choice.per_gpu_gib[choice.pick]
            return replace(fit, problem=f"{said}; {fix} fits ({size:.1f} GiB per GPU on {gpus})")
    return replace(
        fit,
        problem=f"{said}; no layout fits on {gpus} GPU(s): use more nodes or a smaller "
        f"train.micro_batch (rlmctl plan --model {model['name']} --gpu-mem {gpu_mem_gib:g})",
    )

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
from typing import Any

from rlmctl import layouts
from rlmctl.errors import RlmctlError
from rlmctl.records import MemoryEstimate, Plan
from runcontract.config import model_config
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
        return {
            "name": preset,
            "params": param_count(cfg),
            "d_model": cfg.d_model,
            "mlp_hidden": cfg.mlp_hidden,
            "vocab": cfg.vocab_size,
            "stored_blocks": cfg.n_prelude + cfg.n_coda + cfg.n_core * cfg.backprop_depth,
            "n_core": cfg.n_core,
            "seq_len": seq_len or cfg.max_seq_len,
        }
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
    usable = gpu_mem_gib * 2**30 * USABLE_FRACTION - RESERVED_GIB * 2**30
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

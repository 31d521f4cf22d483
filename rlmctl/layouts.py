"""Memory per GPU of each parallel layout on a given cluster, and the cheapest one that fits.

For G GPUs, N per node (shard group of hsdp), P parameters and activations A per GPU:

    ddp      16 P + A                     all-reduce of the gradients (cheapest traffic)
    hsdp     16 P / N + W + A             sharded within a node, replicated across nodes
    fsdp     16 P / G + W + A             sharded over every GPU (all-gathers cross nodes)
    offload  W + A   (16 P / G in host)   fsdp with parameters + AdamW state in host memory

16 B/param: fp32 weights, fp32 gradients, AdamW m and v (rlmctl/plan.py). W is the unsharded
working set FSDP2 keeps on a GPU (trainer/parallel.py): the core blocks stay gathered through the
recurrence (bf16), plus one other block in flight and its fp32 gradient before reduce-scatter.
The layouts are listed cheapest first (by the traffic each adds); the plan picks the first that
fits. Torch-free, like the rest of rlmctl.
"""

from __future__ import annotations

from typing import Any

from rlmctl.records import LayoutChoice

LAYOUTS = ("ddp", "hsdp", "fsdp", "offload")


def working_set_bytes(model: dict[str, Any]) -> int:
    """Unsharded bytes FSDP keeps on a GPU: the gathered core (bf16) plus one block's bf16
    weights and fp32 gradient."""
    d, h = model["d_model"], model["mlp_hidden"]
    block = 4 * d * d + 3 * d * h
    return model.get("n_core", 4) * block * 2 + block * (2 + 4)


def per_gpu(
    model: dict[str, Any], activations: int, gpus: int, gpus_per_node: int
) -> dict[str, int]:
    static = 16 * model["params"]
    work = working_set_bytes(model)
    return {
        "ddp": static + activations,
        "hsdp": static // min(gpus, gpus_per_node) + work + activations,
        "fsdp": static // gpus + work + activations,
        "offload": work + activations,
    }


def choose(
    model: dict[str, Any], activations: int, gpus: int, gpus_per_node: int, usable: float
) -> LayoutChoice:
    """GiB per GPU of every layout and the cheapest layout that fits, or None."""
    sizes = per_gpu(model, activations, gpus, gpus_per_node)
    # On one node hsdp is fsdp with one replica: call it fsdp.
    candidates = [n for n in LAYOUTS if n != "hsdp" or gpus > gpus_per_node]
    pick = next((name for name in candidates if sizes[name] <= usable), None)
    return LayoutChoice({k: v / 2**30 for k, v in sizes.items()}, pick)

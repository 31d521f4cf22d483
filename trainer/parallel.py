"""Sharded data parallelism: FSDP2 (`fully_shard`) per block, 1-D (fsdp) or 2-D (hsdp) meshes.

`parallel.strategy` picks how the ranks hold the model:

    ddp    every rank holds all weights, gradients and AdamW state; gradients all-reduced
           (trainer/distributed.py, with our compression hook)
    fsdp   every rank holds 1/world of each; each block's weights are all-gathered for its
           forward/backward and its gradients reduce-scattered (ZeRO-3)
    hsdp   fsdp within a group of `world / replicas` ranks (a node by default), replicated
           across the `replicas` groups: a 2-D DeviceMesh ("replicate", "shard"); gradients are
           reduce-scattered within the group, then all-reduced across groups

Communication time (`trainer.commtime`) is the time of the all-gathers (forward and backward) and
reduce-scatters; HSDP's all-reduce across the replicas is counted in bytes but not timed (FSDP2
offers a hook after it, none around it).

Sharding units are the blocks of the prelude, of the looped core and of the coda, plus the root
(embedding, adapter, ln_f). The core blocks run r times per forward: they keep their gathered
weights from their first call until backward (`reshard_after_forward=False`) instead of
all-gathering r times; their memory is C blocks of unsharded weights, not r.

Precision (`MixedPrecisionPolicy`): parameters are all-gathered and computed in the training
dtype (bf16 under `train.precision=bf16`), the sharded master weights and AdamW state stay fp32,
and gradients are reduced in fp32 (what the Huginn run did) unless `comm.compression=bf16|fp16`
asks for a cheaper wire dtype. Forward arguments are not cast (`cast_forward_inputs=False`): the
residual stream and the RoPE tables stay fp32 as under DDP's autocast, and the loop's autocast
casts the matmul inputs. fp16 is refused under fsdp/hsdp at config time (`config.validate`):
each rank would find infs only in its own gradient shard and the ranks could disagree on
skipping a step; bf16 needs no scaling.

Checkpoints hold the same full (unsharded) model and optimizer state as under DDP, gathered to
host memory by `full_state` and sharded again by `load_full_state`, so a run can resume on any
strategy and world size.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

# The default collectives FSDP2 runs; we only wrap them to count their payload bytes.
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer import mapped_state
from trainer.commtime import CommTimer
from trainer.config import Config
from trainer.distributed import WIRE_DTYPES, CommStats, DistEnv
from trainer.errors import ConfigError
from trainer.model import RecurrentLM

PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_strategy(cfg: Config, world_size: int, gpu: bool) -> None:
    """One-line ConfigErrors for combinations that cannot work; before the process group forms."""
    p = cfg.parallel
    if p.strategy == "ddp":
        if p.offload:
            raise ConfigError("parallel.offload needs parallel.strategy=fsdp or hsdp")
        return
    if p.offload and not gpu:
        raise ConfigError(
            "parallel.offload=true needs GPUs (it offloads device memory to the host); "
            "set parallel.offload=false"
        )
    if p.strategy == "hsdp":
        replicas = hsdp_replicas(cfg, world_size)
        if replicas < 1 or world_size % replicas:
            raise ConfigError(
                f"parallel.replicas={replicas} must divide the world size {world_size} "
                "(hsdp: world = replicas × ranks per shard group)"
            )


def hsdp_replicas(cfg: Config, world_size: int) -> int:
    """Replica groups of hsdp: `parallel.replicas`, else one per node (torchrun's local world)."""
    if cfg.parallel.replicas:
        return cfg.parallel.replicas
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, world_size // max(1, local))


def build_mesh(cfg: Config, env: DistEnv) -> DeviceMesh:
    device_type = env.device.type
    if cfg.parallel.strategy == "fsdp":
        return init_device_mesh(device_type, (env.world_size,), mesh_dim_names=("shard",))
    replicas = hsdp_replicas(cfg, env.world_size)
    shape = (replicas, env.world_size // replicas)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


class CountingAllGather(DefaultAllGather):
    def __init__(self, stats: ShardedCommStats) -> None:
        self.stats = stats

    def __call__(self, output_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.stats.count(output_tensor.numel() * output_tensor.element_size())
        call = super().__call__
        return timed(self.stats, lambda: call(output_tensor, *args, **kwargs), kwargs)


class CountingReduceScatter(DefaultReduceScatter):
    def __init__(self, stats: ShardedCommStats) -> None:
        self.stats = stats

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        self.stats.count(input_tensor.numel() * input_tensor.element_size())
        call = super().__call__
        return timed(self.stats, lambda: call(output_tensor, input_tensor, *args, **kwargs), kwargs)


def timed(stats: CommStats, collective: Any, kwargs: dict[str, Any]) -> Any:
    """Run one of FSDP's collectives between two marks of `stats.timer`. FSDP calls them on its
    all-gather / reduce-scatter stream, so on a GPU the marks are events on that stream; an async
    one (gloo all-gathers) ends when its future completes."""
    started = stats.timer.start()
    work = collective()
    if kwargs.get("async_op") and work is not None:
        work.get_future().then(lambda _: stats.timer.end(started))
    else:
        stats.timer.end(started)
    return work


class ShardedCommStats(CommStats):
    """Payload bytes of FSDP's all-gathers and reduce-scatters (each sends (n−1)/n of it)."""

    def count(self, nbytes: int) -> None:
        self.payload_bytes += nbytes
        self.calls += 1

    def ring_wire_bytes(self, payload: int) -> float:
        n = self.world_size
        return (n - 1) / n * payload


def shard_model(model: RecurrentLM, cfg: Config, env: DistEnv) -> ShardedCommStats:
    """Apply `fully_shard` to every block and the root, in place; returns the byte counter.

    Call on the model as built on the meta device, then `to_empty` and `init_sharded_weights`
    (no rank ever holds the whole model), and before the optimizer is built: the optimizer must
    hold the sharded parameters.
    """
    mesh = build_mesh(cfg, env)
    wire = WIRE_DTYPES[cfg.comm.compression]
    # cast_forward_inputs=False: FSDP would otherwise cast every floating argument of a block's
    # forward to bf16, the fp32 RoPE tables and the fp32 residual stream included. The loop's
    # autocast casts what the matmuls need, as under DDP, so both strategies compute the same.
    policy = MixedPrecisionPolicy(
        param_dtype=PARAM_DTYPES[cfg.train.precision],
        reduce_dtype=wire or torch.float32,
        cast_forward_inputs=False,
    )
    common: dict[str, Any] = {"mesh": mesh, "mp_policy": policy}
    if cfg.parallel.offload:
        common["offload_policy"] = CPUOffloadPolicy()
    for block in (*model.prelude, *model.coda):
        fully_shard(block, **common)
    for block in model.core:
        fully_shard(block, reshard_after_forward=False, **common)
    fully_shard(model, **common)
    stats = ShardedCommStats(wire, 1.0, env.world_size, CommTimer(env.device))
    replicated = cfg.parallel.strategy == "hsdp" and mesh.size(0) > 1
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(CountingAllGather(stats))
            module.set_custom_reduce_scatter(CountingReduceScatter(stats))
            if replicated:  # hsdp: each gradient shard is all-reduced across the replicas
                module.set_all_reduce_hook(
                    lambda out: stats.count(out.numel() * out.element_size())
                )
    return stats


def init_sharded_weights(model: RecurrentLM) -> None:
    """Initialise a model sharded on the meta device (`shard_model`, then `to_empty`).

    Every rank draws the full tensor of each parameter in turn (same seed, same order as
    `RecurrentLM.init_weights`, so the weights equal those of an unsharded run) and keeps only
    its own shard: the host or device never holds more than one full parameter at a time, instead
    of the whole model on every rank before sharding.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            model.init_parameter(name, full)
            if isinstance(param, DTensor):
                # Local split of the same full tensor on every rank: no communication.
                mine = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                )
                param.to_local().copy_(mine.to_local())
            else:
                param.copy_(full)
            del full
    model.reset_rope()


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Reduce gradients in this backward (`sync`) or keep accumulating them locally: DDP's
    `no_sync`, and FSDP's `set_requires_gradient_sync`."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        yield
    elif not sync and (no_sync := getattr(model, "no_sync", None)) is not None:
        with no_sync():
            yield
    else:
        yield


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """The global gradient norm (over all shards) after clipping to `max_norm`."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts of a sharded model, unsharded in rank 0's host memory (the
    only rank that writes; the others get empty dicts), in the layout `state_dict()` of the
    unsharded model and optimizer has. A collective."""
    model_state = get_model_state_dict(model, options=_FULL)
    named: dict[str, Any] = get_optimizer_state_dict(model, optimizer, options=_FULL)
    if not named:
        return model_state, {}
    # By parameter name -> by parameter index, as torch.optim numbers them.
    order = [fqn for group in named["param_groups"] for fqn in group["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    groups, start = [], 0
    for group in named["param_groups"]:
        count = len(group["params"])
        groups.append({**group, "params": list(range(start, start + count))})
        start += count
    state = {index[fqn]: value for fqn, value in named["state"].items()}
    return model_state, {"state": state, "param_groups": groups}


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optim_state: dict[str, Any],
) -> None:
    """Shard full (unsharded) state dicts into a sharded model and its optimizer, locally and
    tensor by tensor: every rank has the full tensors (memory-mapped from the checkpoint,
    trainer/mapped_state.py), copies the slice of each that is its own shard and lets go of the
    full tensor's pages. No collective, and no rank holds more than its own state plus about
    one tensor of the checkpoint (torch's set_*_state_dict with full state dicts would
    distribute every tensor from rank 0's whole copy)."""
    params = dict(model.named_parameters())
    missing, unexpected = (
        sorted(set(params) - set(model_state)),
        sorted(set(model_state) - set(params)),
    )
    if missing or unexpected:
        raise RuntimeError(
            f"Missing key(s) in state_dict: {missing}; unexpected key(s): {unexpected}"
        )
    with torch.no_grad():
        for name, param in params.items():
            full = model_state[name]
            if full.shape != param.shape:
                raise RuntimeError(
                    f"size mismatch for {name}: copying a param with shape {full.shape} from "
                    f"checkpoint, the shape in current model is {param.shape}."
                )
            _local(param).copy_(_own_slice(full, param))
            mapped_state.release(full)
    if not optim_state:  # an imported checkpoint holds weights only: the optimizer starts fresh
        return
    # In the optimizer's own (index-keyed) format, which is how full checkpoints store it: torch's
    # set_optimizer_state_dict would first run a fake step to create every moment (and a zero
    # gradient per parameter), holding the rank's optimizer state twice.
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in optim_state["param_groups"] for i in group["params"]]
    if len(ids) != len(ordered):
        raise ValueError(f"optimizer state has {len(ids)} parameters, the model {len(ordered)}")
    by_id = dict(zip(ids, ordered, strict=True))
    state = {
        i: {key: _sharded_like(value, by_id[i]) for key, value in entry.items()}
        for i, entry in optim_state["state"].items()
    }
    optimizer.load_state_dict({"state": state, "param_groups": optim_state["param_groups"]})


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _own_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` as `param` is sharded (a view where it can be: the same split
    on every rank, no communication), or `full` itself for an unsharded parameter."""
    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(
        full, param.device_mesh, param.placements, src_data_rank=None
    ).to_local()


def _sharded_like(value: Any, param: torch.Tensor) -> Any:
    """An optimizer state entry in this rank's memory: AdamW's moments (the parameter's shape)
    sharded as the parameter is, anything else (the step count) copied whole."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(param, DTensor) and value.shape == param.shape:
        mine = _own_slice(value, param).clone()
        sharded: torch.Tensor = DTensor.from_local(
            mine, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    else:
        sharded = value.clone()
    mapped_state.release(value)
    return sharded

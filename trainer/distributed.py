"""Process group, device placement and data parallelism with gradient compression.

Launch is torchrun's job: it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Without
them the trainer runs as one process and never creates a process group, so every collective here
is a no-op at world size 1. GPUs use the `nccl` backend (ROCm builds of torch map it to RCCL); CPU
runs use `gloo`.

Gradients are averaged by DDP through one communication hook of ours: it casts each bucket to the
wire dtype (`comm.compression`), divides by the pre-divide factor, all-reduces, divides by
world/factor and casts back, counting the payload bytes handed to the all-reduce.
"""

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.config import CommConfig
from trainer.errors import ConfigError

WIRE_DTYPES: dict[str, torch.dtype | None] = {
    "none": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: single process, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def world_size_from_env() -> int:
    """The world size torchrun announced (1 without torchrun); readable before any setup."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(cfg: CommConfig, device: str = "auto") -> DistEnv:
    """Join the process group torchrun describes and pick this process's device."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise ConfigError(
                f"local rank {local_rank} needs GPU {local_rank} but {visible} are visible; "
                "start at most one process per GPU (torchrun --nproc-per-node) or train.device=cpu"
            )
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        # TF32 tensor cores for fp32 matmuls (bf16 autocast covers most of the rest).
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
    else:
        dev = torch.device("cpu")
    backend = None
    if world_size > 1 or "RANK" in os.environ:
        backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            # Turn a hung or failed collective into an exception instead of a silent hang.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=cfg.timeout_s),
            device_id=dev if use_cuda else None,
        )
    return DistEnv(rank, world_size, local_rank, dev, backend)


def shutdown(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class CommStats:
    """What this rank handed to all-reduce since the last `take()`."""

    wire_dtype: torch.dtype | None
    predivide_factor: float
    world_size: int
    payload_bytes: int = 0
    calls: int = 0

    def take(self) -> int:
        taken, self.payload_bytes, self.calls = self.payload_bytes, 0, 0
        return taken

    def ring_wire_bytes(self, payload: int) -> float:
        """Bytes a ring all-reduce actually sends per rank: 2(n−1)/n of the payload."""
        n = self.world_size
        return 2 * (n - 1) / n * payload


def compression_hook(
    stats: CommStats, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average one gradient bucket in the wire dtype."""
    grad = bucket.buffer()
    wire = grad if stats.wire_dtype is None else grad.to(stats.wire_dtype)
    # Dividing first keeps fp16 sums of many ranks in range; the rest of 1/world comes after.
    wire.div_(stats.predivide_factor)
    stats.payload_bytes += wire.numel() * wire.element_size()
    stats.calls += 1
    post_divide = stats.world_size / stats.predivide_factor
    future = dist.all_reduce(wire, async_op=True).get_future()

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        reduced = fut.value()[0]
        reduced.div_(post_divide)
        if reduced is not grad:
            grad.copy_(reduced)
        return grad

    return future.then(finish)


def wrap_model(model: nn.Module, env: DistEnv, cfg: CommConfig, find_unused: bool) -> nn.Module:
    """DDP around `model` with our compression hook; the model itself at world size 1.

    Not `static_graph`: the core block runs a different number of times every step.
    `find_unused` is needed only when some parameters get no gradient (backprop depth 0).
    """
    if not env.distributed:
        return model
    ddp = DistributedDataParallel(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_mb,
        find_unused_parameters=find_unused,
        gradient_as_bucket_view=True,
    )
    stats = CommStats(WIRE_DTYPES[cfg.compression], cfg.predivide_factor, env.world_size)
    ddp.register_comm_hook(stats, compression_hook)
    ddp.comm_stats = stats  # the loop reads and resets it once per step
    return ddp


def comm_stats(model: nn.Module) -> CommStats | None:
    return getattr(model, "comm_stats", None)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def all_reduce_sum(values: list[float], env: DistEnv) -> list[float]:
    """Sum a few floats over all ranks (loss, token counts, stop flags) in one collective."""
    if not env.distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def gather_objects(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()

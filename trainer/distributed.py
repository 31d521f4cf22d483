"""Process group, device placement and data parallelism with gradient compression.

Launch is torchrun's job: it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Without
them the trainer runs as one process and never creates a process group, so every collective here
is a no-op at world size 1. The torch device type and the process-group backend of GPUs come from
the vendor descriptions (clusterspec/vendors: TORCH_DEVICE, DIST_BACKEND) through one lookup,
`accelerator()`; CPU runs use `gloo`. No other trainer module names a device type or backend.

Gradients are averaged by DDP through one communication hook of ours: it casts each bucket to the
wire dtype (`comm.compression`), divides by the pre-divide factor, all-reduces, divides by
world/factor and casts back, counting the payload bytes handed to the all-reduce and timing it
(`trainer.commtime`).

A hung peer must end the job, not freeze it: `startup_check` is a barrier with a short timeout
that names the ranks (and hosts) that did not answer, followed by a timed all-reduce sweep whose
bus bandwidth rank 0 logs. After it, a stuck collective fails after `comm.timeout_s` (gloo raises;
NCCL/RCCL with async error handling tear the process down).
"""

import logging
import os
import re
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from clusterspec import vendors
from trainer.commtime import CommTimer
from trainer.config import CommConfig
from trainer.errors import ConfigError, UserError
from trainer.rundir import ExitCode

log = logging.getLogger(__name__)

# Startup sweep: 1 KiB to 4 MiB of float32, each size all-reduced a few times.
SWEEP_BYTES = (1 << 10, 1 << 14, 1 << 18, 1 << 22)
SWEEP_REPEATS = 3


class PeerTimeout(UserError):
    """A rank did not answer at startup: exit 1 (restartable, perhaps without that host)."""

    exit_code = ExitCode.FAILED


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
    hosts: tuple[str, ...] = ()  # host name of every rank, in rank order
    startup_group: Any = None  # a gloo group with the short startup timeout
    owns_group: bool = True  # False: the process group was formed by the caller, which keeps it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


@dataclass(frozen=True)
class Accelerator:
    """A torch device type and the process-group backend that goes with it."""

    device_type: str
    backend: str

    @property
    def module(self) -> Any:
        """torch's module of the device type (the same one for NVIDIA and for ROCm builds)."""
        return getattr(torch, self.device_type)

    def available(self) -> bool:
        return self.module.is_available()


CPU = Accelerator("cpu", "gloo")


def accelerator() -> Accelerator:
    """The one lookup of this host's GPU device type and backend: the vendor description of the
    torch build (ROCm builds: amd, else nvidia)."""
    vendor = vendors.VENDORS["amd" if torch.version.hip else "nvidia"]
    return Accelerator(vendor.TORCH_DEVICE, vendor.DIST_BACKEND)


def use_accelerator(device: str) -> bool:
    """train.device: the accelerator when asked for by name, or for auto when one is present."""
    gpu = accelerator()
    return device == gpu.device_type or (device == "auto" and gpu.available())


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings); nothing to wait for on CPU."""
    if device.type != CPU.device_type:
        getattr(torch, device.type).synchronize(device)


def rank_from_env() -> int:
    """This process's rank as torchrun announced it (0 without torchrun); readable before any
    setup."""
    return int(os.environ.get("RANK", "0"))


def world_size_from_env() -> int:
    """The world size torchrun announced (1 without torchrun); readable before any setup."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(cfg: CommConfig, device: str = "auto") -> DistEnv:
    """Join the process group torchrun describes (or the one the caller formed already, which
    the caller keeps: a test that runs several trainings in one group) and pick the device."""
    rank = rank_from_env()
    world_size = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_gpu = use_accelerator(device)
    gpu = accelerator() if use_gpu else CPU
    if use_gpu:
        visible = gpu.module.device_count()
        if local_rank >= visible:
            raise ConfigError(
                f"local rank {local_rank} needs GPU {local_rank} but {visible} are visible; "
                "start at most one process per GPU (torchrun --nproc-per-node) or train.device=cpu"
            )
        gpu.module.set_device(local_rank)
        dev = torch.device(gpu.device_type, local_rank)
        # TF32 tensor cores for fp32 matmuls (bf16 autocast covers most of the rest).
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
    else:
        dev = torch.device("cpu")
    backend = None
    joined = dist.is_available() and dist.is_initialized()
    if joined:  # a caller that runs several trainings in one process group (tests)
        backend = str(dist.get_backend())
        rank, world_size = dist.get_rank(), dist.get_world_size()
    elif world_size > 1 or "RANK" in os.environ:
        backend = gpu.backend
        if use_gpu:
            # Turn a hung or failed collective into an exception instead of a silent hang.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=cfg.timeout_s),
            device_id=dev if use_gpu else None,
        )
    if backend is not None:
        # Right after the rendezvous every rank is alive and here: learn the host names now, so
        # that a rank hanging later can be named; the side group gives the startup check its own
        # short timeout (monitored_barrier exists for gloo only, hence gloo even next to NCCL).
        hosts: list[Any] = [None] * world_size
        dist.all_gather_object(hosts, socket.gethostname())
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.startup_timeout_s))
        return DistEnv(
            rank, world_size, local_rank, dev, backend, tuple(hosts), group, owns_group=not joined
        )
    return DistEnv(rank, world_size, local_rank, dev, backend)


def side_group(cfg: CommConfig) -> Any:
    """A new gloo group over all ranks (a collective), for collectives of a background thread."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout_s))


def shutdown(env: DistEnv, wrapped: nn.Module | None = None) -> None:
    """Destroy the process group; `wrapped` (what wrap_model returned) lets go of DDP's Reducer
    first, while the group has other owners: freed as the group's last owner it joins gloo's
    worker threads with the GIL held, and a worker still freeing a comm-hook tensor waits for the
    GIL forever (a run recorded done whose worker never exits)."""
    if wrapped is not None and hasattr(wrapped, "reducer"):
        del wrapped.reducer
    if env.distributed and env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def startup_check(env: DistEnv, cfg: CommConfig) -> str | None:
    """Fail fast unless every rank answers within `comm.startup_timeout_s`, then time all-reduces.

    Returns rank 0's one-line bandwidth summary (None elsewhere and at world size 1). Raises
    PeerTimeout naming the ranks and hosts that did not answer.
    """
    if env.world_size < 2:
        return None
    timeout = timedelta(seconds=cfg.startup_timeout_s)
    try:
        dist.monitored_barrier(env.startup_group, timeout=timeout, wait_all_ranks=True)
        sweep_group = env.startup_group if env.backend == "gloo" else None
        figures = [_timed_all_reduce(nbytes, env, sweep_group) for nbytes in SWEEP_BYTES]
    except RuntimeError as exc:
        raise PeerTimeout(describe_peer_timeout(exc, env, cfg)) from None
    # The group (and its gloo threads) is not needed again.
    dist.destroy_process_group(env.startup_group)
    if not env.is_main:
        return None
    parts = [f"{_size(n)} {seconds * 1e3:.2f} ms" for n, seconds in figures]
    nbytes, seconds = figures[-1]
    bus = nbytes / seconds * 2 * (env.world_size - 1) / env.world_size
    return (
        f"startup all-reduce over {env.world_size} ranks ({env.backend}): {', '.join(parts)}; "
        f"bus bandwidth {bus / 1e9:.2f} GB/s at {_size(nbytes)}"
    )


def _timed_all_reduce(nbytes: int, env: DistEnv, group: Any) -> tuple[int, float]:
    """(bytes, best seconds of SWEEP_REPEATS) of one all-reduce size; the first call warms up."""
    tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=env.device)
    dist.all_reduce(tensor, group=group)
    best = float("inf")
    for _ in range(SWEEP_REPEATS):
        synchronize(env.device)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        synchronize(env.device)
        best = min(best, time.perf_counter() - start)
    return nbytes, best


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def describe_peer_timeout(exc: RuntimeError, env: DistEnv, cfg: CommConfig) -> str:
    """One line naming the ranks and hosts that did not answer the startup check."""
    # gloo says "Ranks 1, 3 failed to pass monitoredBarrier" on rank 0, and "... send/recv from
    # rank 0" on the others.
    text = str(exc)
    match = re.search(r"Ranks? ([\d, ]+) failed", text) or re.search(r"from rank (\d+)", text)
    ranks = [int(r) for r in re.findall(r"\d+", match.group(1))] if match else []
    if ranks:
        named = ", ".join(f"rank {r} ({_host(env, r)})" for r in ranks)
        what = f"{named} did not answer"
    else:
        lines = text.strip().splitlines()
        what = f"the startup all-reduce did not complete ({lines[0] if lines else 'no detail'})"
    return (
        f"rank {env.rank} ({_host(env, env.rank)}): {what} within "
        f"comm.startup_timeout_s={cfg.startup_timeout_s:g} s; check that host (hung GPU, "
        "stuck filesystem, network) or raise comm.startup_timeout_s"
    )


def _host(env: DistEnv, rank: int) -> str:
    return env.hosts[rank] if rank < len(env.hosts) else "unknown host"


@dataclass
class CommStats:
    """What this rank handed to all-reduce since the last `take()`, and how long it took
    (`timer.take()`)."""

    wire_dtype: torch.dtype | None
    predivide_factor: float
    world_size: int
    timer: CommTimer = field(default_factory=CommTimer)
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
    started = stats.timer.start()
    future = dist.all_reduce(wire, async_op=True).get_future()

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        stats.timer.end(started)
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
    No buffer broadcast per forward: the only buffers are the rope tables, which every rank
    computes identically from the config (DDP still syncs them once at construction).
    """
    if not env.distributed:
        return model
    ddp = DistributedDataParallel(
        model,
        device_ids=[env.device.index] if env.device.type != CPU.device_type else None,
        bucket_cap_mb=cfg.bucket_mb,
        find_unused_parameters=find_unused,
        gradient_as_bucket_view=True,
        forward_sync_buffers=False,
    )
    wire = WIRE_DTYPES[cfg.compression]
    stats = CommStats(wire, cfg.predivide_factor, env.world_size, CommTimer(env.device))
    ddp.register_comm_hook(stats, compression_hook)
    # nn.Module.__setattr__ is typed for tensors and modules only; a plain attribute works.
    ddp.comm_stats = stats  # type: ignore[assignment]  # the loop reads and resets it per step
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


def broadcast_object(obj: Any, env: DistEnv) -> Any:
    """Rank 0's `obj` on every rank."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]

"""The `rlmctl health --deep` probe: a timed all-reduce across every selected host.

Run on the hosts by torchrun (`python -m trainer.allreduce`), like the trainer: gloo on CPU hosts,
NCCL/RCCL on GPU hosts. Rank 0 prints one JSON line with the bus bandwidth, computed the way
nccl-tests does (busbw = algbw × 2(n−1)/n).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """GB/s of bus bandwidth of one all-reduce of `nbytes` taking `seconds` on `world` ranks."""
    algbw = nbytes / seconds / 1e9
    return algbw * 2 * (world - 1) / world if world > 1 else algbw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mb", type=float, default=64.0)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from trainer.distributed import CPU, accelerator, synchronize

    gpu = accelerator()  # the vendor description's device type and backend (NCCL or RCCL)
    target = gpu if gpu.available() else CPU
    dist.init_process_group(target.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(target.device_type, int(os.environ.get("LOCAL_RANK", 0)))
    if target is CPU:
        device = torch.device("cpu")
    else:
        target.module.set_device(device)
    numel = int(args.size_mb * 2**20 / 4)
    tensor = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(tensor)  # warm-up: connections and buffers
    synchronize(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(tensor)
    synchronize(device)
    seconds = (time.perf_counter() - started) / args.iters
    # Every element started at 1 and was summed (1 + iters) times over `world` ranks.
    expected = float(world ** (1 + args.iters))
    correct = bool(torch.allclose(tensor[:16].cpu(), torch.full((16,), expected)))
    if rank == 0:
        result = {
            "world": world,
            "backend": dist.get_backend(),
            "bytes": numel * 4,
            "seconds": seconds,
            "busbw_gbps": bus_bandwidth(numel * 4, seconds, world),
            "correct": correct,
        }
        print("RLMCTL-ALLREDUCE " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

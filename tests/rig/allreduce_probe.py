"""Run by tests/test_rig.py under torchrun on two rig hosts: a real gloo all-reduce across them."""

import socket

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(
        f"rank={rank} world={dist.get_world_size()} host={socket.gethostname()} sum={value.item():g}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Full checkpoints read with bounded host memory: memory-mapped, copied tensor by tensor.

A full checkpoint (`model.pt`, `optimizer.pt`) holds the whole model and AdamW state. Loading it
with a plain `torch.load` puts all of it in every rank's memory at once (3.5 B parameters: ~43 GB
per rank, 8 ranks per node) before a rank keeps what it needs. Instead:

- `load_mapped` maps the file (`torch.load(mmap=True)`): a tensor costs nothing until it is
  read, and then only the pages read, from the page cache the ranks of a node share;
- the loader copies each tensor, or under FSDP only this rank's slice of it, into the rank's own
  storage, and `release` then drops the pages of that tensor from this process's mapping
  (`madvise(MADV_DONTNEED)`: the file is mapped private and never written, so a page dropped is
  only read again from the file if touched again, which it is not).

A rank's resident memory at resume is then its own state plus about one tensor of the file,
instead of its own state plus the whole checkpoint (bench/resume_memory.py measures it).
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path
from typing import Any

import torch

MADV_DONTNEED = 4  # <sys/mman.h> on Linux
PAGE = mmap.PAGESIZE


def _madvise() -> Any:
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()


def load_mapped(path: Path) -> Any:
    """The tensors of a torch.save file, memory-mapped (weights only, on CPU)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def release(value: Any) -> None:
    """Drop the pages of every tensor in `value` that lies in a file mapping of a checkpoint
    (`load_mapped`; already copied) from this process's memory; any other tensor is left alone
    (on anonymous memory MADV_DONTNEED would zero it). Only whole pages inside a tensor's
    storage are dropped."""
    _release(_tensors(value), _mapped_checkpoints())


def copied(value: Any) -> Any:
    """`value` with every tensor copied into memory of its own, each mapped tensor released as
    soon as it is copied: at most one tensor is resident twice at a time."""
    ranges = _mapped_checkpoints()

    def copy(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            own = item.clone()
            _release([item], ranges)
            return own
        if isinstance(item, dict):
            return type(item)((k, copy(v)) for k, v in item.items())
        if isinstance(item, list | tuple):
            return type(item)(copy(v) for v in item)
        return item

    return copy(value)


def _mapped_checkpoints() -> list[tuple[int, int]]:
    """Address ranges of this process's file mappings of checkpoint files (*.pt), read now from
    /proc/self/maps (a mapping that is gone is not in it)."""
    ranges = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n").endswith(".pt"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


def _release(tensors: list[torch.Tensor], ranges: list[tuple[int, int]]) -> None:
    if _MADVISE is None:
        return
    for tensor in tensors:
        storage = tensor.untyped_storage()
        start = -(-storage.data_ptr() // PAGE) * PAGE
        end = (storage.data_ptr() + storage.nbytes()) // PAGE * PAGE
        if end > start and any(low <= start and end <= high for low, high in ranges):
            _MADVISE(start, end - start, MADV_DONTNEED)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []

"""Which files a process opens, from the interpreter's own audit events (PEP 578).

Every `open()`, `Path.open()`, `os.open()` and torch.load of a path raises the "open" audit event
before the file is opened, so a recorder sees each file the checkpoint code reads or writes, not
a model of it. Audit hooks cannot be removed: one hook per process feeds the recorders active now.

    with opened_files(root) as opens:
        ...
    reads = opens.read()  # regular files under root opened read-only
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

_active: list[OpenedFiles] = []
_installed = False


class OpenedFiles:
    def __init__(self, root: Path) -> None:
        self.prefix = os.path.join(os.fspath(Path(root).resolve()), "")
        self.events: list[tuple[str, bool]] = []  # (path, read-only), in order

    def see(self, path: str, mode: str | None, flags: int) -> None:
        path = os.path.abspath(path)
        if not path.startswith(self.prefix) or os.path.isdir(path):
            return
        if mode is not None:
            read_only = "r" in mode and "+" not in mode
        else:
            read_only = flags & os.O_ACCMODE == os.O_RDONLY
        self.events.append((path, read_only))

    def read(self) -> list[Path]:
        """Files under root that were opened read-only (each once, in order of first open)."""
        return list(dict.fromkeys(Path(p) for p, read_only in self.events if read_only))

    def written(self) -> list[Path]:
        return list(dict.fromkeys(Path(p) for p, read_only in self.events if not read_only))


def _hook(event: str, args: tuple) -> None:
    if event != "open" or not _active:
        return
    path, mode, flags = args
    if path is None or isinstance(path, int):
        return
    for recorder in _active:
        recorder.see(os.fsdecode(path), mode, flags or 0)


@contextlib.contextmanager
def opened_files(root: Path) -> Iterator[OpenedFiles]:
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    recorder = OpenedFiles(root)
    _active.append(recorder)
    try:
        yield recorder
    finally:
        _active.remove(recorder)

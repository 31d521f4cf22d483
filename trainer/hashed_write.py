"""Checkpoint files whose sha256 is computed while they are written, never by reading them back.

The manifest of a checkpoint (trainer/rundir.py) lists the sha256 of every file. Reading a
multi-GB file back to hash it costs a second pass over the data (a sharded save measured 2.5-3.6x
the raw write that way); hashing each chunk in a helper thread while the main thread writes it
(hashlib and file writes both release the GIL) costs almost nothing on top of the write.

Both checkpoint formats write through `HashingWriter`: full checkpoints wrap their torch.save
target (trainer/checkpoint.py), sharded ones hand DCP a file system that wraps every stream it
creates (trainer/sharded_checkpoint.py).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

INLINE_HASH_BYTES = 1 << 20  # smaller writes are hashed by the writing thread itself


class HashingWriter:
    """A binary file wrapper that computes the sha256 of what it writes and keeps the OSError of a
    failed write (torch.save reports it as "RuntimeError: unexpected pos ..."; the operator needs
    "No space left on device")."""

    def __init__(self, file: Any, pool: ThreadPoolExecutor) -> None:
        self.file = file
        self.pool = pool
        self.sha256 = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        if memoryview(data).nbytes < INLINE_HASH_BYTES:
            # Zip headers and small records (thousands per save): a thread hop costs more.
            self.sha256.update(data)
            return self._write(data)
        # The caller may reuse `data`'s memory after we return: the hash must be done by then.
        hashing = self.pool.submit(self.sha256.update, data)
        try:
            return self._write(data)
        finally:
            hashing.result()

    def _write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()

    # What DCP's writer asks of a stream besides write: offsets, fsync, close.
    def tell(self) -> int:
        return self.file.tell()

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        self.file.close()

    def hexdigest(self) -> str:
        return self.sha256.hexdigest()


@contextlib.contextmanager
def without_zip_crc32() -> Iterator[None]:
    """torch.save without its per-record CRC32: the manifest's sha256 covers every byte already,
    and the CRC would be one more pass over the data (~20 % of a save). The option is process-wide,
    hence the restore; only one checkpoint save runs at a time."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)

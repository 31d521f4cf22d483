"""Sharded checkpoints through `torch.distributed.checkpoint` (DCP): every rank writes its shards.

With `checkpoint.format=sharded` a checkpoint directory holds

    dcp/.metadata            DCP's index of every tensor shard (written by rank 0)
    dcp/__<rank>_<n>.distcp  the tensor data each rank wrote: model and optimizer state
    trainer_state.pt         scheduler, grad scaler, progress, RNG states, config (rank 0)
    manifest.json            size + sha256 of every file above, written last by rank 0

The protocol is the one of full checkpoints (trainer/checkpoint.py): rank 0 creates the hidden
temp directory and broadcasts its name; every rank writes its DCP shards into it and hashes the
files while it writes them (no second pass over the data); rank 0 gathers the digests, writes trainer_state.pt and the manifest, fsyncs and
renames the directory into place. A crash at any point leaves a hidden temp directory, never a
`step-*` name on incomplete data.

Async (`checkpoint.async_save=true`): `dcp.async_save` returns at once; DCP's stager copies the
tensors to host memory in a thread of its own (buffers kept from one save to the next), and the
training loop waits for that copy only before its next optimizer step changes the tensors
(`CheckpointStore.wait_for_staging`). The writes, the digests and the rename run in one
background thread per rank, on a gloo process group of their own (collectives from a second
thread must not interleave with the training loop's on the default group).

Resume reads with `dcp.load` into the state dict of the model as it is now sharded, so each rank
reads only the byte ranges of its own shards, whatever world size and strategy wrote them.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from trainer.hashed_write import HashingWriter, without_zip_crc32

DCP_DIR = "dcp"
# DCP writer threads (and shard files) per rank: one file's sha256 is a sequential pass slower
# than the write, so one file per rank leaves the save hash-bound with a core idle.
WRITER_THREADS = 2
FORMAT_KEY = "checkpoint_format"  # set to "sharded" on a state read from a sharded checkpoint


def is_sharded(path: Path) -> bool:
    return (path / DCP_DIR).is_dir()


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model and optimizer state as DCP saves and loads it: by parameter name, each rank
    holding its own shards (plain tensors for an unsharded model)."""
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }


def apply_tensor_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    set_model_state_dict(model, state["model"])
    if state["optimizer"]:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    else:  # an imported checkpoint (weights only): the optimizer starts fresh, without the
        optimizer.state.clear()  # zero-gradient step by which `tensor_state` built its template


class _HashingFileSystem(FileSystem):
    """DCP's local file system, hashing every file while DCP writes it (trainer/hashed_write.py):
    the manifest gets each shard's sha256 without reading the shard back.

    Failures name their file (DCP itself reports only the exception). A write stream never
    raises: its first error is kept in `write_errors` with the path and later bytes go nowhere,
    and `ShardWrite.digests` raises it once DCP is done. DCP runs its extra writer threads
    without catching anything (an error there would be printed as a traceback and the file
    left out of a "successful" save), so an error must not escape any of them. Reads raise, with
    the path in an OSError that had none, and `failed_path` names the file of any other error
    (a shard that does not unpickle). `before_open` (tests: fault injection) is called with
    each path before it is opened."""

    def __init__(self, before_open: Callable[[Path], None] | None = None) -> None:
        super().__init__()
        self.digests: dict[str, str] = {}  # file name in dcp/ -> sha256 of what was written
        self.before_open = before_open or (lambda path: None)
        self.failed_path: Path | None = None
        self.write_errors: list[tuple[Path, BaseException]] = []  # from any writer thread

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" in mode:
            with self._write_stream(Path(path), mode) as stream:
                yield stream
            return
        try:
            self.before_open(Path(path))
            with super().create_stream(path, mode) as stream:
                yield stream
        except OSError as exc:
            self.failed_path = Path(path)
            if exc.filename is None:
                raise OSError(exc.errno, exc.strerror, str(path)) from exc
            raise
        except Exception:
            self.failed_path = Path(path)
            raise

    @contextlib.contextmanager
    def _write_stream(self, path: Path, mode: str) -> Iterator[Any]:
        failed: BaseException | None = None
        yielded = False
        try:
            with contextlib.ExitStack() as stack:
                try:
                    self.before_open(path)
                    stream = stack.enter_context(super().create_stream(path, mode))
                except OSError as exc:
                    failed, stream = exc, stack.enter_context(open(os.devnull, "wb"))
                pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-sha256")
                stack.enter_context(pool)
                stack.enter_context(without_zip_crc32())
                writer = HashingWriter(stream, pool)
                try:
                    yielded = True
                    yield writer
                except Exception as exc:  # a write or the fsync: DCP goes on, the save fails
                    failed = failed or writer.error or exc
        except Exception as exc:  # closing (flushing) the file
            if not yielded:
                raise
            failed = failed or exc
        if failed is not None:
            self.write_errors.append((path, failed))
        else:
            self.digests[path.name] = writer.hexdigest()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        # DCP writes .metadata.tmp and renames it to .metadata.
        super().rename(path, new_path)
        digest = self.digests.pop(Path(path).name, None)
        if digest is not None:
            self.digests[Path(new_path).name] = digest


def background_stager() -> DefaultStager:
    """DCP's stager for async saves: copies the tensors to host memory (pinned on GPUs) in a
    thread of its own and keeps those buffers for the next save."""
    accelerator = torch.accelerator.is_available()
    options = StagingOptions(
        use_pinned_memory=accelerator,
        use_shared_memory=False,  # the writer is a thread of this process
        use_async_staging=True,
        use_non_blocking_copy=accelerator,
    )
    return DefaultStager(options)


def rank_failures(exc: BaseException) -> dict[int, BaseException]:
    """The failure of each rank that DCP gathered into a CheckpointException (every rank of a
    failed `dcp.save`/`dcp.load` gets the same dict); empty for any other exception."""
    if not isinstance(exc, CheckpointException):
        return {}
    return {rank: failure for rank, (failure, _) in exc.failures.items()}


class Staged:
    """`wait()` returns once DCP's stager has copied the tensors (an Event's interface)."""

    def __init__(self, future: Any) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        """True once the copy is done (or failed), False if `timeout` passed first."""
        done, _ = futures.wait([self._future], timeout)
        if not done:
            return False
        # A failed copy surfaces from the write's future; DCP's own CheckpointException is a
        # BaseException, which `except Exception` would let through.
        with contextlib.suppress(Exception, CheckpointException):
            self._future.result()
        return True


class ShardWrite:
    """This rank's DCP write into `tmp/dcp`, in flight (async, with `stager`) or done (sync).
    A failure raises DCP's CheckpointException on every rank (naming each failing rank's error),
    from the constructor (sync) or from `digests` (async)."""

    def __init__(
        self,
        tensors: dict[str, Any],
        tmp: Path,
        group: Any,
        stager: Any,
        before_write: Callable[[Path], None] | None = None,
    ) -> None:
        self._files = _HashingFileSystem(before_write)
        writer = FileSystemWriter(tmp / DCP_DIR, thread_count=WRITER_THREADS)
        writer.fs = self._files  # what DCP writes goes through the hashing streams
        self._future = None
        self.staged: Staged | None = None
        if stager is None:
            dcp.save(tensors, storage_writer=writer, process_group=group)
            return
        response = dcp.async_save(
            tensors, storage_writer=writer, process_group=group, async_stager=stager
        )
        if not isinstance(response, AsyncSaveResponse):  # a stager that staged synchronously
            raise TypeError(f"{type(stager).__name__} must stage in the background")
        self.staged = Staged(response.staging_completion)
        self._future = response.upload_completion

    @property
    def failed_path(self) -> Path | None:
        """The file this rank's write failed on, if it did."""
        return self._files.failed_path

    def digests(self) -> dict[str, str]:
        """Wait for the write; the sha256 of every file this rank wrote (rank 0 also wrote
        .metadata), by manifest name. DCP has fsynced each file. Raises this rank's first write
        error (an OSError naming the file), or DCP's CheckpointException."""
        if self._future is not None:
            self._future.result()
        if self._files.write_errors:
            path, error = self._files.write_errors[0]
            if isinstance(error, OSError):
                raise OSError(error.errno, error.strerror, str(path)) from error
            self._files.failed_path = path
            raise error
        return {f"{DCP_DIR}/{name}": digest for name, digest in self._files.digests.items()}


class UnreadableShards(Exception):
    """`dcp.load` failed on one rank or more: `failures` maps each failing rank to its error,
    `failed_path` is the file this rank failed on (None when this rank read all of its own)."""

    def __init__(self, failures: dict[int, BaseException], failed_path: Path | None) -> None:
        super().__init__(f"ranks {sorted(failures)} could not read their shards")
        self.failures = failures
        self.failed_path = failed_path


def read_shards(
    path: Path, template: dict[str, Any], before_read: Callable[[Path], None] | None = None
) -> dict[str, Any]:
    """Fill `template` (from `tensor_state`) from the checkpoint at `path`; each rank reads the
    parts of the files its own shards need. A collective; UnreadableShards on every rank when
    any rank fails."""
    group = None if not dist.is_initialized() else dist.group.WORLD
    try:
        stored = FileSystemReader(path / DCP_DIR).read_metadata().state_dict_metadata
    except Exception:  # unreadable here: dcp.load below fails on this rank, and all ranks agree
        stored = None
    if stored is not None and not any(key.startswith("optimizer.") for key in stored):
        template = {**template, "optimizer": {}}  # `import-hf --format sharded`: weights only
    reader = FileSystemReader(path / DCP_DIR)
    reader.fs = files = _HashingFileSystem(before_read)
    try:
        dcp.load(template, storage_reader=reader, process_group=group)
    except CheckpointException as exc:
        raise UnreadableShards(rank_failures(exc), files.failed_path) from None
    return template


def read_model_weights(path: Path, model: torch.nn.Module) -> None:
    """The model weights of a sharded checkpoint, whatever world size and strategy wrote them,
    into an unsharded model in this one process (export, generate); the optimizer shards are not
    read."""
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path / DCP_DIR), no_dist=True)
    model.load_state_dict(state["model"])

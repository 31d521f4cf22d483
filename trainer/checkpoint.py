"""Durable checkpoints: atomic directory saves, retention, async save and resume selection.

One checkpoint is one directory ``<run_dir>/checkpoints/step-00001000/`` holding

    model.pt           the model state_dict
    optimizer.pt       the optimizer state_dict
    trainer_state.pt   scheduler, grad scaler, data progress, per-rank RNG states, config, version
    manifest.json      sizes and sha256 of the files above (`rundir.write_manifest`), written last

Atomicity: everything is written into a hidden sibling ``.tmp-step-00001000-<host>-<pid>`` (a name
that never matches ``step-XXXXXXXX``), each file and the directory are fsynced, the directory is
renamed into place and the parent directory is fsynced. A crash at any moment therefore leaves the
earlier checkpoints plus either nothing or the new complete one under a ``step-*`` name; leftovers
are only ever hidden temp directories, which resume ignores. docs/checkpoints.md has the argument.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from runcontract.config import CheckpointConfig as CheckpointConfig
from trainer import mapped_state, sharded_checkpoint
from trainer.errors import ConfigError, DataError, UserError
from trainer.hashed_write import HashingWriter, without_zip_crc32
from trainer.rundir import (
    CHECKPOINT_DIR_RE,
    MANIFEST_NAME,
    CheckpointInfo,
    EventKind,
    ExitCode,
    RunDir,
    checkpoint_dir_name,
    read_json,
    sha256_file,
    verify_checkpoint,
    write_manifest,
)

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
# One file per concern: a reader that only needs the weights (export, generate) reads model.pt.
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.pt"
# Pickle framing, the manifest and filesystem block rounding on top of the raw tensor bytes.
SIZE_SLACK_BYTES = 1 << 20


@dataclass(frozen=True)
class Ranks:
    """The two collectives by which the ranks of a run agree on a checkpoint; the defaults are
    those of a single process."""

    broadcast: Callable[[Any], Any] = lambda obj: obj  # rank 0's object, on every rank
    gather: Callable[[Any], list[Any]] = lambda obj: [obj]  # every rank's object, in rank order
    # A gloo group of its own for sharded saves, whose collectives may run in a background thread.
    checkpoint_group: Any = None
    hosts: tuple[str, ...] = ()  # host name of every rank, in rank order (for messages)

    def gather_for_checkpoint(self, obj: Any) -> list[Any]:
        """`gather` on the checkpoint group (safe from the async save thread)."""
        if self.checkpoint_group is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.checkpoint_group)
        dist.all_gather_object(out, obj, group=self.checkpoint_group)
        return out


class UnreadableFile(Exception):
    """One checkpoint file could not be loaded; names the file."""

    def __init__(self, path: Path, cause: BaseException) -> None:
        super().__init__(f"{path.parent.name}/{path.name} ({_why(cause)})")
        self.path = path


class CheckpointError(UserError):
    """A save failed with `checkpoint.on_error=stop`: exit 1, a restart may succeed."""

    exit_code = ExitCode.FAILED


def state_nbytes(obj: Any) -> int:
    """Bytes of tensor storage in a nested state; shared storages (tied weights) count once."""
    seen: dict[tuple[int, str], int] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if hasattr(value, "to_local"):  # a DTensor: this rank's shard
                value = value.to_local()
            storage = value.untyped_storage()
            seen[(storage.data_ptr(), str(value.device))] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)

    visit(obj)
    return sum(seen.values())


def to_host(obj: Any, staging: dict[tuple[Any, ...], torch.UntypedStorage] | None = None) -> Any:
    """A deep copy of a nested state with every tensor in host memory.

    Tensors that share a storage (tied weights, views) still share one copied storage, so the
    async file holds the same bytes as a sync save of the live state would. `staging` keeps the
    host buffers between calls (keyed by where a tensor sits in the state): copying into memory
    that is already mapped is several times faster than first-touching fresh pages, and that copy
    is the whole training stall of an async save.
    """
    copies: dict[tuple[int, str], torch.UntypedStorage] = {}
    staging = {} if staging is None else staging

    def copy_tensor(t: torch.Tensor, where: tuple[Any, ...]) -> torch.Tensor:
        t = t.detach()
        source = t.untyped_storage()
        key = (source.data_ptr(), str(t.device))
        host = copies.get(key)
        if host is None:
            host = staging.get(where)
            if host is None or host.nbytes() != source.nbytes():
                host = torch.UntypedStorage(source.nbytes())
                if t.device.type != "cpu":
                    host = host.pin_memory()
                staging[where] = host
            host.copy_(source)
            copies[key] = host
        return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())

    def visit(value: Any, where: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            return copy_tensor(value, where)
        if isinstance(value, dict):
            return type(value)((k, visit(v, (*where, k))) for k, v in value.items())
        if isinstance(value, list):
            return [visit(v, (*where, i)) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(visit(v, (*where, i)) for i, v in enumerate(value))
        # Python/numpy RNG states and scheduler fields: small, and mutated by training later.
        return copy.deepcopy(value)

    return visit(obj, ())


def private_containers(obj: Any) -> Any:
    """The nested state with its own dicts, lists and tuples and a deep copy of every value that
    is not a tensor; the tensors themselves are the live ones (an async save copies them in its
    background thread, `CheckpointStore.wait_for_staging`)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):
        return type(obj)((k, private_containers(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [private_containers(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(private_containers(v) for v in obj)
    return copy.deepcopy(obj)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, path: Path) -> str:
    """Write `obj` with torch.save, fsync it, and return its sha256 (computed while writing, in a
    helper thread: trainer/hashed_write.py)."""
    with (
        open(path, "wb") as f,
        without_zip_crc32(),
        ThreadPoolExecutor(1, thread_name_prefix="checkpoint-sha256") as pool,
    ):
        writer = HashingWriter(f, pool)
        try:
            torch.save(obj, writer)  # type: ignore[arg-type]  # any .write() works; stub: IO
        except RuntimeError as exc:
            if writer.error is not None:
                raise writer.error from exc
            raise
        f.flush()
        os.fsync(f.fileno())
    return writer.hexdigest()


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _why(exc: BaseException) -> str:
    """An exception in one line without the path an OSError repeats (the caller names the
    file): "OSError: [Errno 28] No space left on device"."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: [Errno {exc.errno}] {exc.strerror}"
    return _first_line(exc)


def _json_safe(value: Any) -> Any:
    """The value if it survives JSON, else its repr: manifest meta must never break a save."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# The training loop's waits on checkpoint threads go in slices: Python runs a signal's handler
# only between bytecodes, so a SIGTERM whose C-level handler ran just before a plain join began
# would not be seen before the join ended (a hung save: never), and a second SIGTERM would then
# count as the first.
SIGNAL_CHECK_S = 0.5


def _join(thread: threading.Thread) -> None:
    while thread.is_alive():
        thread.join(SIGNAL_CHECK_S)


class CheckpointStore:
    """Saves and loads the checkpoints of one run; only rank 0 writes.

    `save` returns False (and counts a failure) when a save did not produce a checkpoint; with
    `on_error=stop` it raises CheckpointError instead. With `async_save` the write runs in a
    background thread: `save` returns once the state is copied to host memory, a failure of the
    background write surfaces at the next `save` or `wait`. Call `wait()` before the process exits.
    """

    def __init__(
        self,
        run_dir: RunDir,
        cfg: CheckpointConfig,
        rank: int,
        world_size: int,
        ranks: Ranks | None = None,
    ) -> None:
        cfg.validate()
        self.ranks = ranks or Ranks()
        self.run_dir = run_dir
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.saves = 0
        self.failures = 0
        self.last_saved_step: int | None = None
        self.last_save_seconds = 0.0  # wall time of the newest successful write (any thread)
        self.loaded_path: Path | None = None
        self._thread: threading.Thread | None = None
        # Retention deletes in the background (as torchtitan's purge thread does): removing an old
        # checkpoint is most of a save's cost beyond the write, and training need not wait for it.
        self._purges: list[threading.Thread] = []
        self._purging: set[Path] = set()
        self._pending_error: CheckpointError | None = None
        self._staging: dict[tuple[Any, ...], torch.UntypedStorage] = {}  # async host buffers
        # Set once the async save in flight has its own copy of the tensors (`wait_for_staging`).
        self._staged: threading.Event | sharded_checkpoint.Staged | None = None
        self._shard_stager: Any = None  # DCP's stager, kept: it reuses its host buffers
        self._host = socket.gethostname()
        # Called with a phase name at each step of a save; lets tests stop a save at a known point.
        self.phase_hook: Callable[[str], object] = lambda phase: None
        # Sharded checkpoints are read into the state dict of the model as it is sharded now.
        self.tensor_template: Callable[[], dict[str, Any]] | None = None
        # Called with each file before it is read; lets tests make one rank's read fail.
        self.read_hook: Callable[[Path], None] = lambda path: None
        # Called with each shard file before a sharded save writes it; lets tests fail a write.
        self.write_hook: Callable[[Path], None] = lambda path: None
        # Checkpoints every rank skipped at resume or rollback because some rank could not read
        # them: a save of the same step sets them aside instead of keeping them as "already saved".
        self._unreadable: set[Path] = set()

    # saving ------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any]) -> bool:
        if self.cfg.format == "sharded":
            return self._save_sharded(step, state)
        if self.rank != 0:
            return True
        self._wait_for_write()
        try:
            self.run_dir.checkpoints_dir.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temp_dirs()
            self._check_free_space(state_nbytes(state))
        except OSError as exc:
            return self._failed(step, exc, None)
        if not self.cfg.async_save:
            return self._write(step, state)
        # The copy of the tensors to host memory runs in the background thread too: training is
        # blocked only if it reaches its next optimizer step before the copy is done
        # (`wait_for_staging`). What is not a tensor is copied now: the loop changes it next.
        self._staged = threading.Event()
        args = (step, private_containers(state), self._staged)
        self._thread = threading.Thread(
            target=self._stage_and_write, args=args, name=f"checkpoint-{step}", daemon=False
        )
        self._thread.start()
        return True

    def wait_for_staging(self) -> None:
        """Block until the async save in flight has copied the tensors it saves to host memory.
        The training loop calls this before its optimizer step changes them in place (as
        torchtitan waits for staging); it returns at once when no copy is in progress."""
        if self._staged is not None:
            while not self._staged.wait(SIGNAL_CHECK_S):
                pass

    def _stage_and_write(self, step: int, state: dict[str, Any], staged: threading.Event) -> bool:
        try:
            snapshot = to_host(state, self._staging)
        except Exception as exc:
            return self._failed(step, exc, None)
        finally:
            staged.set()
        return self._write(step, snapshot)

    def wait(self) -> None:
        """Block until the async save in flight (if any) and retention's deletes have finished;
        raise the save's stop error."""
        try:
            self._wait_for_write()  # first: a background save may start deletes of its own
        finally:
            for purge in self._purges:
                _join(purge)
            self._purges.clear()

    def _wait_for_write(self) -> None:
        if self._thread is not None:
            _join(self._thread)
            self._thread = None
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _tmp_dir(self, step: int) -> Path:
        name = f"{TMP_PREFIX}{checkpoint_dir_name(step)}-{self._host}-{os.getpid()}"
        return self.run_dir.checkpoints_dir / name

    def _write(self, step: int, state: dict[str, Any]) -> bool:
        started = time.perf_counter()
        final = self.run_dir.checkpoint_path(step)
        tmp = self._tmp_dir(step)
        try:
            existing = verify_checkpoint(final) if final.exists() else None
            if existing is not None and existing.valid and final not in self._unreadable:
                # A SIGTERM save right after an interval save: the same step is already durable.
                log.info("checkpoint: %s already exists, not written again", final)
                self.last_saved_step = step
                return True
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            self.phase_hook("tmp-created")
            digests = self._save_files(state, tmp)
            self.phase_hook("files-written")
            meta = {
                "progress": _json_safe(state.get("progress")),
                "version": _json_safe(state.get("version")),
                "world_size": self.world_size,
            }
            manifest = write_manifest(tmp, step, meta, digests=digests)
            _fsync_dir(tmp)
            self.phase_hook("manifest-written")
            if existing is not None:
                self._set_aside_invalid(self._why_replaced(existing))
            os.rename(tmp, final)
            self.phase_hook("renamed")
            _fsync_dir(final.parent)
        except Exception as exc:  # any failure must leave training running
            return self._failed(step, exc, tmp)
        return self._published(step, final, manifest, started)

    def _save_files(self, state: dict[str, Any], tmp: Path) -> dict[str, str]:
        """model.pt and optimizer.pt written at the same time, by two threads: a file's sha256 is
        one sequential pass, slower than the write itself, so one file after the other leaves a
        core idle and the save hash-bound (measured 1.2-1.8x the raw write). The sha256 of each
        file by name; trainer_state.pt (small) after optimizer.pt."""

        def save_model() -> str:
            digest = _save_file(state["model"], tmp / MODEL_FILE)
            self.phase_hook(f"written:{MODEL_FILE}")
            return digest

        # Leaving the block waits for the model writer, also when the optimizer's write failed:
        # no thread is still writing into `tmp` when a failure removes it.
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-model") as side:
            model = side.submit(save_model)
            digests = {OPTIMIZER_FILE: _save_file(state.get("optimizer"), tmp / OPTIMIZER_FILE)}
            rest = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
            digests[TRAINER_STATE_FILE] = _save_file(rest, tmp / TRAINER_STATE_FILE)
            digests[MODEL_FILE] = model.result()
        return digests

    def _published(self, step: int, final: Path, manifest: dict[str, Any], started: float) -> bool:
        self.saves += 1
        self.last_saved_step = step
        self.last_save_seconds = time.perf_counter() - started
        size = sum(entry["size"] for entry in manifest["files"].values())
        log.info(
            "checkpoint: saved %s (%.1f MB in %.2f s)", final, size / 1e6, self.last_save_seconds
        )
        # A full disk must not turn a checkpoint that is safely saved into a crash.
        with contextlib.suppress(OSError):
            self.run_dir.append_event(
                EventKind.CHECKPOINT,
                step=step,
                path=str(final),
                bytes=size,
                seconds=self.last_save_seconds,
            )
        self.phase_hook("done")
        self._prune(keep_step=step)
        return True

    # sharded saves (trainer/sharded_checkpoint.py) ------------------------------------------------
    def _save_sharded(self, step: int, state: dict[str, Any]) -> bool:
        """Every rank writes its DCP shards into rank 0's temp directory; rank 0 publishes it."""
        self._wait_for_write()
        started = time.perf_counter()
        # Every rank writes its own shards to the same filesystem: rank 0 checks room for all.
        sizes = self.ranks.gather(state_nbytes({k: state[k] for k in ("model", "optimizer")}))
        prepared: tuple[str, str] | None = None
        if self.rank == 0:
            prepared = self._prepare_sharded(step, sum(sizes))
        kind, where = self.ranks.broadcast(prepared)
        if kind == "exists":
            self.last_saved_step = step
            return True
        if kind == "error":
            return self._failed(step, OSError(where), None)
        tmp = Path(where)
        tensors = {"model": state["model"], "optimizer": state["optimizer"]}
        if self.cfg.async_save:  # DCP's stager reads them in its thread, while the loop goes on
            tensors = private_containers(tensors)
        rest = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
        try:
            if self.cfg.async_save and self._shard_stager is None:
                self._shard_stager = sharded_checkpoint.background_stager()
            write = sharded_checkpoint.ShardWrite(
                tensors, tmp, self.ranks.checkpoint_group, self._shard_stager, self.write_hook
            )
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            failure = RuntimeError(self._shard_failure(exc, "write", None))
            return self._failed(step, failure, tmp if self.rank == 0 else None)
        if not self.cfg.async_save:
            return self._finish_sharded(step, tmp, rest, write, started)
        # DCP copies the tensors to host memory in its staging thread (`wait_for_staging`); the
        # rest is small but changed by training, so it is copied now.
        self._staged = write.staged
        args = (step, tmp, to_host(rest), write, started)
        self._thread = threading.Thread(
            target=self._finish_sharded, args=args, name=f"checkpoint-{step}", daemon=False
        )
        self._thread.start()
        return True

    def _prepare_sharded(self, step: int, nbytes: int) -> tuple[str, str]:
        """Rank 0: ("write", temp dir), ("exists", path) or ("error", why); `nbytes`: the
        tensor bytes all ranks will write."""
        final = self.run_dir.checkpoint_path(step)
        try:
            self.run_dir.checkpoints_dir.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temp_dirs()
            self._check_free_space(nbytes)
            if final.exists() and verify_checkpoint(final).valid and final not in self._unreadable:
                log.info("checkpoint: %s already exists, not written again", final)
                return "exists", str(final)
            tmp = self._tmp_dir(step)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as exc:
            return "error", str(exc).strip().splitlines()[0]
        return "write", str(tmp)

    def _finish_sharded(
        self,
        step: int,
        tmp: Path,
        rest: dict[str, Any],
        write: sharded_checkpoint.ShardWrite,
        started: float,
    ) -> bool:
        """Every rank: wait for its shards and their digests; rank 0: trainer_state.pt, manifest,
        rename. Collectives only on the checkpoint group (this may be the async thread)."""
        problem, mine = None, {}
        try:
            mine = write.digests()
            self.phase_hook(f"shards-written:{step}")
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            problem = self._shard_failure(exc, "write", write.failed_path)
        try:
            gathered = self.ranks.gather_for_checkpoint((mine, problem))
        except Exception as exc:  # a rank died mid-save: nothing may be published
            lost = RuntimeError(f"{self._who(self.rank)} lost its peers ({_first_line(exc)})")
            return self._failed(step, lost, tmp if self.rank == 0 else None)
        # DCP tells every rank about every failing rank: one entry per distinct report.
        problems = list(dict.fromkeys(p for _, p in gathered if p))
        if self.rank != 0:
            ok = not problems or self._failed(step, RuntimeError("; ".join(problems)), None)
            if ok:
                self.saves += 1
                self.last_saved_step = step
            self._agree_done()  # rank 0 has published (or given up)
            return ok
        try:
            if problems:
                raise RuntimeError("; ".join(problems))
            final = self.run_dir.checkpoint_path(step)
            digests = {name: digest for files, _ in gathered for name, digest in files.items()}
            digests[TRAINER_STATE_FILE] = _save_file(rest, tmp / TRAINER_STATE_FILE)
            meta = {
                "progress": _json_safe(rest.get("progress")),
                "version": _json_safe(rest.get("version")),
                "world_size": self.world_size,
                "format": "sharded",
            }
            manifest = write_manifest(tmp, step, meta, digests=digests)
            _fsync_dir(tmp / sharded_checkpoint.DCP_DIR)
            _fsync_dir(tmp)
            self.phase_hook("manifest-written")
            if final.exists():
                self._set_aside_invalid(self._why_replaced(verify_checkpoint(final)))
            os.rename(tmp, final)
            _fsync_dir(final.parent)
        except Exception as exc:
            ok = self._failed(step, exc, tmp)
        else:
            ok = self._published(step, final, manifest, started)
        self._agree_done()
        return ok

    def _agree_done(self) -> None:
        """The last collective of a sharded save: every rank waits for rank 0's rename. A peer
        that died by now finds its death reported by the training loop's next collective."""
        try:
            self.ranks.gather_for_checkpoint(None)
        except Exception as exc:
            log.warning("checkpoint: a peer left during the save's last step: %s", _first_line(exc))

    def _failed(self, step: int, exc: BaseException, tmp: Path | None) -> bool:
        """Count a save that did not produce a checkpoint (every rank of a sharded save calls
        this with the same gathered reason; rank 0 says it)."""
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        self.failures += 1
        message = (
            f"checkpoint {checkpoint_dir_name(step)} not saved: {_first_line(exc)}; "
            f"earlier checkpoints in {self.run_dir.checkpoints_dir} are untouched"
        )
        if self.rank == 0:
            log.error("error: %s", message)
            with contextlib.suppress(OSError):  # the same full disk; the log line is the record
                self.run_dir.append_event(
                    EventKind.CHECKPOINT_FAILED, step=step, error=_first_line(exc)
                )
        if self.cfg.on_error == "stop":
            error = CheckpointError(f"{message} (checkpoint.on_error=stop)")
            if threading.current_thread() is self._thread:
                self._pending_error = error
            else:
                raise error
        return False

    def _who(self, rank: int) -> str:
        hosts = self.ranks.hosts
        host = hosts[rank] if rank < len(hosts) else (self._host if rank == self.rank else "?")
        return f"rank {rank} ({host})"

    def _relative(self, path: Path) -> str:
        """A checkpoint file as the operator finds it: relative to checkpoints/."""
        try:
            return str(Path(path).relative_to(self.run_dir.checkpoints_dir))
        except ValueError:
            return str(path)

    def _shard_failure(self, exc: BaseException, verb: str, own_path: Path | None) -> str:
        """One line naming each failing rank, its host, the file and why, e.g. "rank 1 (node2)
        cannot write .tmp-step-00000002-.../dcp/__1_0.distcp (OSError: [Errno 28] No space left
        on device)". DCP hands every rank every rank's exception; an OSError names its file, any
        other failure is placed by this rank's own record of the file it failed on."""
        failures = sharded_checkpoint.rank_failures(exc) or {self.rank: exc}
        parts = []
        for rank, failure in sorted(failures.items()):
            filename = getattr(failure, "filename", None)
            path = Path(filename) if filename else (own_path if rank == self.rank else None)
            where = f" {self._relative(path)}" if path is not None else " its shards"
            parts.append(f"{self._who(rank)} cannot {verb}{where} ({_why(failure)})")
        return "; ".join(parts)

    @staticmethod
    def _why_replaced(info: CheckpointInfo) -> CheckpointInfo:
        if info.valid:  # verified, but some rank could not read it at resume
            return dataclasses.replace(info, reason="a rank could not read it at resume")
        return info

    def _check_free_space(self, nbytes: int) -> None:
        needed = nbytes + SIZE_SLACK_BYTES + self.cfg.min_free_bytes
        free = shutil.disk_usage(self.run_dir.checkpoints_dir).free
        if free < needed:
            raise OSError(
                28,
                f"needs about {_mib(needed)} free, {_mib(free)} available "
                f"(free space or lower checkpoint.keep_last)",
                str(self.run_dir.checkpoints_dir),
            )

    def _set_aside_invalid(self, info: CheckpointInfo) -> None:
        """Move an invalid checkpoint at the step being saved out of the way, kept for inspection."""
        aside = info.path.with_name(f".invalid-{info.path.name}-{int(time.time())}")
        log.warning(
            "checkpoint: %s is invalid (%s); moved to %s, delete it when inspected",
            info.path,
            info.reason,
            aside.name,
        )
        os.rename(info.path, aside)

    def _remove_stale_temp_dirs(self) -> None:
        """Delete temp dirs of crashed saves on this host (dead pid); never a step-* directory."""
        for path in self.run_dir.checkpoints_dir.glob(f"{TMP_PREFIX}*-{self._host}-*"):
            pid_text = path.name.rsplit("-", 1)[-1]
            if not pid_text.isdigit() or not path.is_dir():
                continue
            pid = int(pid_text)
            if path in self._purging:
                continue  # this process's own retention is deleting it
            if pid == os.getpid() or not _pid_alive(pid):
                log.info("checkpoint: removing %s left by an interrupted save", path.name)
                shutil.rmtree(path, ignore_errors=True)

    # retention ---------------------------------------------------------------------------------
    def retained(self, infos: list[CheckpointInfo], keep_step: int | None = None) -> set[int]:
        """Steps to keep: the newest `keep_last` valid ones, milestones, `keep_step`, all invalid."""
        valid = [info.step for info in infos if info.valid]
        if self.cfg.keep_last == 0:
            return {info.step for info in infos}
        keep = set(valid[-self.cfg.keep_last :])
        if self.cfg.keep_every:
            keep |= {s for s in valid if s % self.cfg.keep_every == 0}
        if keep_step is not None:
            keep.add(keep_step)
        keep |= {info.step for info in infos if not info.valid}
        return keep

    def _prune(self, keep_step: int | None = None) -> None:
        try:
            infos = self.run_dir.checkpoints()
        except OSError as exc:
            log.warning("checkpoint: retention skipped: %s", _first_line(exc))
            return
        keep = self.retained(infos, keep_step)
        for info in infos:
            if info.step in keep:
                continue
            # Rename first so that a crash mid-delete leaves a temp dir, never a half step-* dir.
            doomed = info.path.with_name(
                f"{TMP_PREFIX}delete-{info.path.name}-{self._host}-{os.getpid()}"
            )
            try:
                os.rename(info.path, doomed)
            except OSError as exc:
                log.warning("checkpoint: could not remove %s: %s", info.path, _first_line(exc))
                continue
            self._purge(doomed, info.path.name)
        self._purges = [purge for purge in self._purges if purge.is_alive()]

    def _purge(self, doomed: Path, name: str) -> None:
        """Delete a renamed-away checkpoint in a background thread (joined by `wait`); a crash
        mid-delete leaves a temp dir that the next save's stale-temp sweep removes."""

        def delete() -> None:
            try:
                shutil.rmtree(doomed)
                log.info("checkpoint: removed %s (retention)", name)
            except OSError as exc:
                log.warning("checkpoint: could not remove %s: %s", doomed, _first_line(exc))
            finally:
                self._purging.discard(doomed)

        self._purging.add(doomed)
        purge = threading.Thread(target=delete, name=f"checkpoint-purge-{name}", daemon=False)
        self._purges.append(purge)
        purge.start()

    # loading -----------------------------------------------------------------------------------
    def load(self) -> dict[str, Any] | None:
        """The state of the checkpoint chosen by `cfg.resume` on CPU, or None to start fresh.

        A collective: rank 0 lists the candidates once; every rank checks and reads each in turn
        and the first one that every rank could read is the one all of them resume from.
        """
        resume = self.cfg.resume.strip()
        if resume == "never":
            return None
        if resume != "auto":
            path = self._resume_path(resume)
            state, problems = self._read_on_every_rank(path)
            if problems:
                raise ConfigError(
                    f"checkpoint.resume={resume} is not a usable checkpoint: {'; '.join(problems)}; "
                    "pick another with `python -m trainer checkpoints RUN_DIR`"
                )
            self._warn_newer(self._step_of(path))
            return state
        listing: Any = None
        if self.rank == 0:
            try:
                listing = self._listing()
            except OSError as exc:  # every rank must stop, not just rank 0
                listing = f"{self._who(0)} cannot list {self.run_dir.checkpoints_dir} ({_why(exc)})"
        listing = self.ranks.broadcast(listing)
        if isinstance(listing, str):
            raise DataError(
                f"{listing}; fix the filesystem, or start over with checkpoint.resume=never"
            )
        candidates, damaged = listing
        # Every candidate has a manifest, so when none is readable the DataError below stops.
        state = self._first_readable(candidates, none_left="none left: the resume stops")
        if state is None and damaged:
            newest, reason = damaged[-1]
            raise DataError(
                f"none of the {len(damaged)} checkpoint(s) in {self.run_dir.checkpoints_dir} is "
                f"usable (newest {newest}: {reason or 'unreadable'}); restore them, resume from "
                "one with checkpoint.resume=PATH, or start from step 0 with checkpoint.resume=never"
            )
        return state

    def _listing(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Rank 0: the valid checkpoints newest first, and those that were complete once."""
        candidates = []
        checkpoints = self.run_dir.checkpoints()
        for info in reversed(checkpoints):
            if info.valid:
                candidates.append(str(info.path))
            else:
                self._warn(f"checkpoint: skipping {info.path}: {info.reason}")
        # Checkpoints that were complete once (a manifest): if none is usable now, starting
        # again from step 0 would silently throw their progress away. The operator decides.
        damaged = [i for i in checkpoints if (i.path / MANIFEST_NAME).exists()]
        return candidates, [(i.path.name, i.reason) for i in damaged]

    def _first_readable(self, candidates: list[str], none_left: str) -> dict[str, Any] | None:
        """The state of the first candidate every rank can read; all ranks skip the others.
        `none_left` says in the warning what happens after the last candidate fails."""
        for i, name in enumerate(candidates):
            state, problems = self._read_on_every_rank(Path(name))
            if not problems:
                return state
            self._unreadable.add(Path(name))
            instead = Path(candidates[i + 1]).name if i + 1 < len(candidates) else none_left
            for problem in problems:
                self._warn(f"checkpoint: {problem}; all ranks fall back to {instead}")
        return None

    def _read_on_every_rank(self, path: Path) -> tuple[dict[str, Any] | None, list[str]]:
        """(this rank's state, []) when every rank verified and read `path`; else (None, one
        problem per failing rank, naming the rank, the file and why). A collective."""
        problem = self._verify_share(path)
        problems = self._problems(self.ranks.gather(problem))
        if problems:
            return None, problems
        state = None
        try:
            state = self.read(path)
        except UnreadableFile as exc:  # a corrupt or unreadable file must not stop the resume
            problem = f"cannot read {exc}"
        except sharded_checkpoint.UnreadableShards as exc:
            # Every rank learns every rank's failure from DCP: each reports only its own (all
            # of them when DCP names none), so the warning names the rank that failed.
            mine = exc.failures.get(self.rank) if exc.failures else exc
            if mine is not None:
                filename = getattr(mine, "filename", None)
                failed = Path(filename) if filename else exc.failed_path
                where = (
                    self._relative(failed)
                    if failed
                    else f"{path.name}/{sharded_checkpoint.DCP_DIR}"
                )
                problem = f"cannot read {where} ({_why(mine)})"
        problems = self._problems(self.ranks.gather(problem))
        if problems:
            self.loaded_path = None
            return None, problems
        return state, []

    def _problems(self, per_rank: list[str | None]) -> list[str]:
        return [f"{self._who(r)} {p}" for r, p in enumerate(per_rank) if p is not None]

    def _verify_share(self, path: Path) -> str | None:
        """Why this rank must not resume from `path`, or None. Every rank checks the sizes of all
        files; with verify=full the sha256 work is split: file i is hashed by rank i % world."""
        try:
            self.read_hook(path / MANIFEST_NAME)
        except OSError as exc:
            return f"cannot read {path.name}/{MANIFEST_NAME} ({_why(exc)})"
        info = verify_checkpoint(path)
        if not info.valid:
            return f"cannot use {path.name} ({info.reason})"
        if self.cfg.verify != "full":
            return None
        manifest = read_json(path / MANIFEST_NAME) or {}
        names = sorted(manifest.get("files", {}))
        for name in names[self.rank :: self.world_size]:
            try:
                digest = sha256_file(path / name)
            except OSError as exc:
                return f"cannot read {path.name}/{name} ({_first_line(exc)})"
            if digest != manifest["files"][name].get("sha256"):
                return f"cannot use {path.name}/{name} (does not match its sha256)"
        return None

    @staticmethod
    def _step_of(path: Path) -> int:
        match = CHECKPOINT_DIR_RE.match(path.name)
        return int(match.group(1)) if match else -1

    def _resume_path(self, resume: str) -> Path:
        path = Path(resume)
        if not path.exists() and (self.run_dir.checkpoints_dir / resume).exists():
            path = self.run_dir.checkpoints_dir / resume
        if not path.is_dir() or not CHECKPOINT_DIR_RE.match(path.name):
            raise ConfigError(
                f"checkpoint.resume={resume} is not a checkpoint directory (step-XXXXXXXX); "
                "use auto, never or a path like RUN_DIR/checkpoints/step-00001000"
            )
        return path

    def rollback_candidates(self, step: int) -> list[str]:
        """Valid checkpoints older than `step`, newest first (rollback targets); rank 0 lists."""
        return [
            str(i.path) for i in reversed(self.run_dir.checkpoints()) if i.valid and i.step < step
        ]

    def roll_back_state(self, step: int) -> dict[str, Any] | None:
        """The state of the newest checkpoint older than `step` that every rank can read."""
        candidates = self.rollback_candidates(step) if self.rank == 0 else None
        candidates = self.ranks.broadcast(candidates)
        return self._first_readable(candidates, none_left="none left: no rollback")

    def set_aside_newer(self, step: int) -> None:
        """After a rollback to `step`: hide the newer checkpoints of the abandoned trajectory.

        They are renamed (kept for inspection, never resumed from, never pruned), so that a later
        save of the same step writes the new state instead of keeping the old one.
        """
        if self.rank != 0:
            return
        for info in self.run_dir.checkpoints():
            if info.step > step:
                aside = info.path.with_name(f".rolled-back-{info.path.name}-{int(time.time())}")
                os.rename(info.path, aside)
                log.warning(
                    "checkpoint: %s belongs to the rolled-back steps; moved to %s, delete it "
                    "when inspected",
                    info.path.name,
                    aside.name,
                )
        self.last_saved_step = step

    def read(self, path: Path) -> dict[str, Any]:
        """A checkpoint's whole state on CPU; records it as `loaded_path`."""
        if sharded_checkpoint.is_sharded(path):
            return self._read_sharded(path)
        # Memory-mapped: each rank reads only the pages it copies into its own state
        # (trainer/mapped_state.py), not the whole checkpoint into its memory.
        model = self._load_file(path / MODEL_FILE, mapped=True)
        optimizer = self._load_file(path / OPTIMIZER_FILE, mapped=True)
        # Written by this module; holds Python and numpy RNG state objects that the weights-only
        # unpickler rejects.
        rest = self._load_file(path / TRAINER_STATE_FILE, weights_only=False)
        self.loaded_path = path
        if self.rank == 0:
            log.info("checkpoint: loading %s", path)
        return {"model": model, "optimizer": optimizer, **rest}

    def _read_sharded(self, path: Path) -> dict[str, Any]:
        """Each rank's own shards (a collective), then trainer_state.pt on every rank: in this
        order, a rank that fails on its own file never leaves the others waiting in `dcp.load`."""
        shards = path / sharded_checkpoint.DCP_DIR
        if self.tensor_template is None:
            raise UnreadableFile(shards, RuntimeError("sharded: read it with the trainer"))
        # A failure on any rank raises UnreadableShards on every rank (`_read_on_every_rank`).
        tensors = sharded_checkpoint.read_shards(path, self.tensor_template(), self.read_hook)
        rest = self._load_file(path / TRAINER_STATE_FILE, weights_only=False)
        self.loaded_path = path
        if self.rank == 0:
            log.info("checkpoint: loading %s (sharded)", path)
        return {**tensors, **rest, sharded_checkpoint.FORMAT_KEY: "sharded"}

    def _load_file(self, path: Path, weights_only: bool = True, mapped: bool = False) -> Any:
        try:
            self.read_hook(path)
            if mapped:
                return mapped_state.load_mapped(path)
            return torch.load(path, map_location="cpu", weights_only=weights_only)
        except Exception as exc:
            raise UnreadableFile(path, exc) from exc

    def _warn_newer(self, step: int) -> None:
        newer = [i.path.name for i in self.run_dir.checkpoints() if i.valid and i.step > step]
        if newer:
            self._warn(
                f"checkpoint: resuming from step {step} although newer checkpoints exist "
                f"({', '.join(newer)}); a later resume=auto would pick those"
            )

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            log.warning("%s", message)


class CheckpointManager:
    """Owns what a run's checkpoints hold (the registered components) and when one is written.

    Components register with `rolled_back=True` when a rollback restores them (model, optimizer,
    step); the others (data cursor, counters, RNG) keep moving forward. `save`, `load` and
    `roll_back` are collectives: every rank calls them at the same step; rank 0 writes, and the
    store's `Ranks` make all ranks agree on the checkpoint they read.
    """

    def __init__(
        self, store: CheckpointStore, interval_steps: int, constants: dict[str, Any]
    ) -> None:
        self.store = store
        self.interval_steps = interval_steps
        self.constants = constants  # saved as they are (config, version)
        self._components: list[tuple[Any, bool]] = []
        self.saved_step: int | None = None  # the step of the newest checkpoint of this run
        # Seconds the loop was blocked by checkpointing (save calls, waits for an async save's
        # copy or write): the run's checkpoint stall (runcontract.goodput).
        self.stall_seconds = 0.0

    def register(self, component: Any, *, rolled_back: bool = False) -> None:
        self._components.append((component, rolled_back))

    def state_dict(self) -> dict[str, Any]:
        """The registered components' entries merged into one checkpoint dict."""
        state: dict[str, Any] = {}
        for component, _ in self._components:
            for key, value in component.state_dict().items():
                if isinstance(value, dict) and isinstance(state.get(key), dict):
                    state[key] = {**state[key], **value}
                else:
                    state[key] = value
        return {**state, **self.constants}

    def save(self, step: int, last: bool = False) -> bool:
        """Save at every `interval_steps` and when `last` (final step, stop request) unless this
        step is already saved. True when a save was made (or started, with async_save)."""
        due = step % self.interval_steps == 0 or last
        if not due or step == self.saved_step:
            return False
        with self._stalling():
            self.store.save(step, self.state_dict())
        self.saved_step = step
        return True

    @contextlib.contextmanager
    def _stalling(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.stall_seconds += time.perf_counter() - started

    def load(self) -> bool:
        """Resume every component from the checkpoint `checkpoint.resume` picks; False: fresh."""
        state = self.store.load()
        if state is None:
            return False
        try:
            for component, _ in self._components:
                component.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise ConfigError(self._mismatch(state, exc)) from None
        self.saved_step = state["progress"]["step"]
        return True

    def _mismatch(self, state: dict[str, Any], exc: BaseException) -> str:
        """One line: which tensor does not fit, and which model keys differ from the checkpoint."""
        detail = next(
            (line.strip() for line in str(exc).splitlines() if "size mismatch" in line),
            _first_line(exc),
        )
        saved = (state.get("config") or {}).get("model") or {}
        wanted = (self.constants.get("config") or {}).get("model") or {}
        changed = [
            f"model.{k}={wanted.get(k)!r} (saved: {saved[k]!r})"
            for k in saved
            if saved[k] != wanted.get(k)
        ]
        keys = ", ".join(changed) if changed else "the model config"
        return (
            f"checkpoint {self.loaded_path} does not fit this model: {detail[:160]}; {keys}; "
            "resume with the run's own config.yaml or start a new run_dir"
        )

    def roll_back(self, before_step: int) -> tuple[Path, dict[str, Any]] | None:
        """Restore the rolled-back components from the newest verified checkpoint older than
        `before_step`; newer checkpoints are set aside. None when there is no such checkpoint."""
        self.store.wait()  # an async save in flight may be the target
        state = self.store.roll_back_state(before_step)
        if state is None:
            return None
        path = self.store.loaded_path
        assert path is not None, "roll_back_state sets loaded_path with the state it returns"
        for component, rolled_back in self._components:
            if rolled_back:
                component.load_state_dict(state)
        self.saved_step = state["progress"]["step"]
        self.store.set_aside_newer(self.saved_step)
        return path, state

    def wait(self) -> None:
        with self._stalling():
            self.store.wait()

    def wait_for_staging(self) -> None:
        """Before the optimizer step: an async save must have copied the tensors it saves."""
        with self._stalling():
            self.store.wait_for_staging()

    @property
    def loaded_path(self) -> Path | None:
        return self.store.loaded_path

    @property
    def saves(self) -> int:
        return self.store.saves

    @property
    def failures(self) -> int:
        return self.store.failures

"""The run directory: the on-disk contract between the trainer, rlmctl and the exporter.

It lives on the shared filesystem (Lustre in production). Everything that reads or writes it goes
through this module, which imports only the standard library so that `rlmctl` and `rlm-exporter`
start fast and never pull in torch.

Layout::

    <run_dir>/
      run.json                          who created the run, from which inventory, when (rlmctl)
      config.yaml                       effective trainer config, written once when the run is made
      trainer.lock                      held (flock) by the trainer that owns the run; holder inside
      metrics.jsonl                     one JSON object per logged step (rank 0 appends)
      status.json                       newest progress snapshot (`Status`), replaced atomically
      events.jsonl                      lifecycle events (`Event`, `EventKind`)
      checkpoints/step-00001000/        one directory per checkpoint; manifest.json written last
      hosts/<host>/launch.json          what rlmctl started on that host (pid, pgid, command)
      hosts/<host>/launcher.log         stdout+stderr of that host's torchrun
      hosts/<host>/exit.json            how that host's attempt ended (`end_attempt`): the
                                        attempt's exit code, torchrun's own, when

The run's state of record is the fold of events.jsonl through `TRANSITIONS` (`RunDir.state`);
the exit code of an attempt is `attempt_exit_code` of its events and exit records. The rlmctl
registry is only an index from run names to these directories.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runcontract.exitcodes import attempt_exit_code
from runcontract.records import Event, Status, fold_state
from runcontract.states import (
    EVENT_STATES,
    TRAINER_END_EVENTS,
    EventKind,
    RunState,
    allowed,
)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
CHECKPOINT_DIR_RE = re.compile(r"^step-(\d{8})$")
# Run names become directory names, rendezvous ids and Prometheus label values.
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
RUN_NAME_MAX = 64


def check_run_name(name: str) -> str | None:
    """Why `name` cannot name a run, or None when it can."""
    if not name:
        return "the run name is empty"
    if len(name) > RUN_NAME_MAX:
        return f"run name has {len(name)} characters; use at most {RUN_NAME_MAX}"
    if not RUN_NAME_RE.match(name):
        return (
            f"run name {name!r} may only use letters, digits, '-', '_' and '.', "
            "and must start with a letter or digit"
        )
    return None


class RunDirBusy(Exception):
    """Another live trainer holds the run directory; `str()` names it and what to do."""


class RunDirUnwritable(Exception):
    """The run directory cannot be written (read-only, permissions, missing filesystem)."""


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON so that readers see either the old or the new file, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Any | None:
    """The parsed file, or None when it is missing or half-written."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    # One write() of a whole line, so concurrent readers never see half a record on POSIX.
    line = json.dumps(record, sort_keys=True) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a JSON-lines file; a torn last line (writer still busy) is ignored."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError):
                    yield json.loads(line)
    except FileNotFoundError:
        return


def sha256_file(path: Path, chunk_bytes: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    valid: bool
    reason: str  # "ok" or why the checkpoint must not be used
    size_bytes: int
    mtime: float

    @property
    def age_seconds(self) -> float:
        return max(0.0, time.time() - self.mtime)


def verify_checkpoint(path: Path, full: bool = False) -> CheckpointInfo:
    """Check a checkpoint directory against its manifest.

    The quick check compares every file's size; `full` also compares sha256 digests. A checkpoint
    without a manifest is partial by definition: the manifest is written last.
    """
    path = Path(path)
    match = CHECKPOINT_DIR_RE.match(path.name)
    step = int(match.group(1)) if match else -1

    def result(valid: bool, reason: str, size: int = 0) -> CheckpointInfo:
        try:
            mtime = path.stat().st_mtime
        except OSError:
            mtime = 0.0
        return CheckpointInfo(step, path, valid, reason, size, mtime)

    try:
        manifest = read_json(path / MANIFEST_NAME)
    except OSError as error:  # an I/O error, not a missing file: the checkpoint cannot be used
        return result(False, f"cannot read {MANIFEST_NAME} ({error.strerror or error})")
    if manifest is None:
        return result(False, "no readable manifest.json (partial or interrupted save)")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        return result(False, "manifest.json lists no files")
    if manifest.get("step") != step:
        return result(False, f"manifest step {manifest.get('step')} does not match directory")
    total = 0
    for name, entry in sorted(files.items()):
        file_path = path / name
        try:
            size = file_path.stat().st_size
        except OSError:
            return result(False, f"{name} is missing")
        if size != entry.get("size"):
            return result(False, f"{name} has {size} bytes, manifest says {entry.get('size')}")
        try:
            if full and sha256_file(file_path) != entry.get("sha256"):
                return result(False, f"{name} does not match its sha256")
        except OSError as error:
            return result(False, f"cannot read {name} ({error.strerror or error})")
        total += size
    return result(True, "ok", total)


def write_manifest(
    path: Path,
    step: int,
    meta: dict[str, Any] | None = None,
    digests: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Describe every file under a finished checkpoint directory; call after all files are synced.

    `digests` maps file names to the sha256 their writer computed while writing; files without
    one are read back and hashed here.
    """
    path = Path(path)
    files = {}
    for file_path in sorted(p for p in path.rglob("*") if p.is_file()):
        name = file_path.relative_to(path).as_posix()
        if name == MANIFEST_NAME:
            continue
        digest = (digests or {}).get(name) or sha256_file(file_path)
        files[name] = {"size": file_path.stat().st_size, "sha256": digest}
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "created": time.time(),
        "files": files,
        "meta": meta or {},
    }
    write_json_atomic(path / MANIFEST_NAME, manifest)
    return manifest


def trainer_exit_codes(events: list[Event], since: float) -> list[int]:
    """The codes the trainer recorded for the attempt that began at `since`, oldest first."""
    return [
        code
        for e in events
        if e.kind in TRAINER_END_EVENTS and e.time >= since and (code := e.exit_code) is not None
    ]


class RunDir:
    """Paths and small readers/writers of one run directory."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def run_record_path(self) -> Path:
        return self.path / "run.json"

    @property
    def lock_path(self) -> Path:
        return self.path / "trainer.lock"

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def status_path(self) -> Path:
        return self.path / "status.json"

    @property
    def events_path(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    def host_dir(self, host: str) -> Path:
        return self.path / "hosts" / host

    def launch_record_path(self, host: str) -> Path:
        return self.host_dir(host) / "launch.json"

    def launcher_log_path(self, host: str) -> Path:
        return self.host_dir(host) / "launcher.log"

    def exit_record_path(self, host: str) -> Path:
        return self.host_dir(host) / "exit.json"

    def create(self) -> RunDir:
        for directory in (self.path, self.checkpoints_dir, self.path / "hosts"):
            directory.mkdir(parents=True, exist_ok=True)
        return self

    def create_exclusive(self, config_text: str, record: dict[str, Any]) -> RunDir:
        """Make a new run directory and fill it; FileExistsError when the name is taken.

        mkdir is the atomic test-and-set: of two launches of one name exactly one gets here, and
        the other has written nothing. config.yaml is written once, here, and never replaced.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.mkdir()
        try:
            self.create()
            self.config_path.write_text(config_text, encoding="utf-8")
            write_json_atomic(self.run_record_path, {"name": self.name, **record})
        except BaseException:
            self.discard()
            raise
        return self

    @contextlib.contextmanager
    def hold(self) -> Iterator[dict[str, Any]]:
        """Own the run directory for as long as the block runs: an exclusive flock on
        trainer.lock, which names the holder (host, PID). The kernel drops the lock when its
        process dies, so a stale trainer.lock of a dead trainer is simply taken over.

        RunDirBusy when a live trainer holds it; RunDirUnwritable when it cannot be written.
        Nothing in the directory is changed by a refusal.
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise RunDirUnwritable(self._unwritable(error)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirUnwritable(self._unwritable(error)) from None
            holder = read_json(self.lock_path) or {}
            since = holder.get("since")
            when = time.strftime(" since %H:%M:%S", time.localtime(since)) if since else ""
            raise RunDirBusy(
                f"run directory {self.path} is in use by the trainer with PID "
                f"{holder.get('pid', '?')} on {holder.get('host', '?')}{when}; stop it first "
                "(rlmctl stop RUN, or kill that PID) or choose another run_dir"
            ) from None
        try:
            previous = read_json(self.lock_path) or {}
            holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        except OSError as error:
            os.close(fd)
            raise RunDirUnwritable(self._unwritable(error)) from None
        try:
            yield previous  # the dead holder whose lock was taken over, if any
        finally:
            os.close(fd)  # releases the flock

    def _unwritable(self, error: OSError) -> str:
        why = "is on a read-only filesystem" if error.errno == errno.EROFS else "is not writable"
        return (
            f"run directory {self.path} {why} ({error.strerror}); mount it read-write or point "
            "run_dir at a writable shared directory"
        )

    def discard(self) -> None:
        """Remove a run directory that no trainer has started in (a launch that went no further)."""
        shutil.rmtree(self.path, ignore_errors=True)

    # progress -----------------------------------------------------------------------------------
    def write_status(
        self,
        *,
        state: RunState,
        step: int | None = None,
        max_steps: int | None = None,
        loss: float | None = None,
        tokens_per_s: float | None = None,
        updated: float | None = None,
        exit_code: int | None = None,
        step_time: float | None = None,
        comm_time: float | None = None,
        checkpoint_interval_steps: int | None = None,
    ) -> Status:
        """Replace status.json with this snapshot (`updated`: now unless given); the `Status`
        written. An unknown field is a TypeError, an unknown state a ValueError."""
        status = Status(
            state=RunState(state),
            step=step,
            max_steps=max_steps,
            loss=loss,
            tokens_per_s=tokens_per_s,
            updated=time.time() if updated is None else updated,
            exit_code=exit_code,
            step_time=step_time,
            comm_time=comm_time,
            checkpoint_interval_steps=checkpoint_interval_steps,
        )
        write_json_atomic(self.status_path, status.to_dict())
        return status

    def read_status(self) -> dict[str, Any]:
        """status.json as written (an empty mapping while there is none); `status()` typed."""
        status = read_json(self.status_path)
        return status if isinstance(status, dict) else {}

    def status(self) -> Status:
        return Status.from_dict(self.read_status())

    def append_metrics(self, record: dict[str, Any]) -> None:
        append_jsonl(self.metrics_path, record)

    def read_metrics(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.metrics_path))

    def append_event(self, kind: EventKind, /, **fields: Any) -> Event:
        """Append one line to events.jsonl (an unknown kind is a ValueError); the `Event`."""
        event = Event(time.time(), EventKind(kind).value, fields)
        append_jsonl(self.events_path, event.to_dict())
        return event

    def read_events(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.events_path))

    def events(self) -> list[Event]:
        return [Event.from_dict(record) for record in read_jsonl(self.events_path)]

    def state(self) -> RunState | None:
        """The state of record: events folded through TRANSITIONS (None: nothing happened yet)."""
        return fold_state(self.events())

    def record(self, kind: EventKind, /, **fields: Any) -> bool:
        """Append a lifecycle event if it is allowed from the current state; False (and nothing
        written) when it is not, e.g. `stopped` for a run that is already done."""
        new = EVENT_STATES.get(EventKind(kind))
        state = self.state()
        if new is not None and new != state and not allowed(state, new):
            return False
        self.append_event(kind, **fields)
        return True

    def restarts(self) -> int:
        """The one meaning of "restarts": trainer starts after the first one (watch restarts,
        `rlmctl resume`, Slurm requeues), counted from `start` events."""
        starts = sum(1 for event in self.events() if event.kind == EventKind.START)
        return max(0, starts - 1)

    # the end of an attempt ----------------------------------------------------------------------
    def attempt_since(self, events: list[Event] | None = None) -> float:
        """When the newest attempt began: its `launched` event (rlmctl, a Slurm batch script),
        or a `start` that no `launched` announced (a trainer started by hand, torchrun's own
        restart); 0 when there is none. The first `start` after a `launched` is that attempt's
        own: a host may end before rank 0 says it (failed at once while rank 0 still imported
        torch), and its exit record belongs to the attempt."""
        events = self.events() if events is None else events
        since, announced = 0.0, False
        for event in events:
            if event.kind == EventKind.LAUNCHED:
                since, announced = event.time, True
            elif event.kind == EventKind.START:
                since = since if announced else event.time
                announced = False
        return since

    def exit_records(self, since: float) -> dict[str, dict[str, Any]]:
        """Per host, its exit record (hosts/<host>/exit.json) if written by this attempt (the
        launcher shell of older versions wrote whole seconds, hence the second of slack)."""
        records = {}
        hosts = self.path / "hosts"
        for path in sorted(hosts.glob("*/exit.json")) if hosts.is_dir() else []:
            record = read_json(path)
            if not isinstance(record, dict):
                continue
            code, when = record.get("exit_code"), record.get("time")
            if isinstance(code, int) and isinstance(when, int | float) and when >= since - 1:
                records[path.parent.name] = record
        return records

    def attempt_exit_code(self, events: list[Event] | None = None) -> int | None:
        """The exit code of the newest attempt (`exitcodes.attempt_exit_code`): the trainer's own
        (`exit`/`start_refused` events since the attempt began), else the hosts' exit records;
        None while it runs."""
        events = self.events() if events is None else events
        since = self.attempt_since(events)
        trainer = trainer_exit_codes(events, since)
        launchers = [record["exit_code"] for record in self.exit_records(since).values()]
        return attempt_exit_code(trainer, launchers)

    def attempt_exit_codes(self, events: list[Event] | None = None) -> list[int]:
        """`attempt_exit_code` as a list (empty while the attempt runs), for rlm-exporter."""
        code = self.attempt_exit_code(events)
        return [] if code is None else [code]

    def end_attempt(self, host: str, launcher_code: int, **record: Any) -> int:
        """What a launcher (rlmctl's launcher shell, the Slurm node wrapper) does when its torchrun
        has ended: take the attempt's exit code (the trainer's own before torchrun's), write it
        with torchrun's own into hosts/<host>/exit.json, and, when the trainer never got as far as
        a `start` (it refused, or died before it could say anything), record `launch_failed`
        so that the run does not stay `launching`. The attempt's exit code."""
        events = self.events()
        since = self.attempt_since(events)
        trainer = trainer_exit_codes(events, since)
        code = attempt_exit_code(trainer, [launcher_code])
        assert code is not None
        exit_record = {**record, "exit_code": code, "launcher_exit_code": launcher_code}
        path = self.exit_record_path(host)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**exit_record, "time": time.time()})
        if code != 0 and fold_state(events) is RunState.LAUNCHING:
            self.record(
                EventKind.LAUNCH_FAILED,
                host=host,
                exit_code=code,
                reason=f"the trainer on {host} ended with exit code {code} before it started",
            )
        return code

    # checkpoints --------------------------------------------------------------------------------
    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints_dir / checkpoint_dir_name(step)

    def checkpoints(self, full: bool = False) -> list[CheckpointInfo]:
        """Every checkpoint directory, oldest first, each with its verification result."""
        if not self.checkpoints_dir.is_dir():
            return []
        entries = [
            verify_checkpoint(p, full=full)
            for p in self.checkpoints_dir.iterdir()
            if p.is_dir() and CHECKPOINT_DIR_RE.match(p.name)
        ]
        return sorted(entries, key=lambda info: info.step)

    def latest_valid_checkpoint(self, full: bool = False) -> CheckpointInfo | None:
        valid = [info for info in self.checkpoints(full=full) if info.valid]
        return valid[-1] if valid else None

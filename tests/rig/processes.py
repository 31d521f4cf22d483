"""Stopping processes by PID, safely: a PID is only signalled while it is still the process the rig
recorded (same start time), so a recycled PID never hits an unrelated process."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

POLL_S = 0.02


@dataclass(frozen=True)
class ProcessId:
    pid: int
    start_ticks: int  # field 22 of /proc/PID/stat: unique together with the PID

    def to_json(self) -> list[int]:
        return [self.pid, self.start_ticks]

    @classmethod
    def from_json(cls, value: list[int]) -> ProcessId:
        return cls(int(value[0]), int(value[1]))


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after its closing one.
    return stat[stat.rindex(")") + 2 :].split()


def identify(pid: int) -> ProcessId | None:
    fields = _stat_fields(pid)
    return None if fields is None else ProcessId(pid, int(fields[19]))


def is_running(proc: ProcessId) -> bool:
    """True while the recorded process exists and is not a zombie."""
    fields = _stat_fields(proc.pid)
    return fields is not None and int(fields[19]) == proc.start_ticks and fields[0] != "Z"


def _signal_all(procs: Iterable[ProcessId], sig: signal.Signals) -> None:
    for proc in procs:
        if is_running(proc):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)


def _wait_gone(procs: list[ProcessId], timeout_s: float) -> list[ProcessId]:
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if is_running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(POLL_S)
        alive = [p for p in alive if is_running(p)]
    return alive


def terminate(procs: Iterable[ProcessId], grace_s: float = 3.0) -> list[ProcessId]:
    """SIGTERM, wait up to `grace_s`, then SIGKILL. Returns the processes still running after that."""
    procs = list(dict.fromkeys(procs))
    _signal_all(procs, signal.SIGTERM)
    alive = _wait_gone(procs, grace_s)
    _signal_all(alive, signal.SIGKILL)
    return _wait_gone(alive, 5.0)

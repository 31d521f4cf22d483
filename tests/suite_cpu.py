"""Where the test suite's CPU goes: a command (`make test`) run under the kernel's process
accounting, every process that ended summed into what it belonged to.

    make test-cpu                                  # as root: make test, then the tables
    python -m tests.suite_cpu --keep FILE [--timeline T] -- CMD    # FILE keeps the records
    python -m tests.suite_cpu --read FILE [--timeline T]           # the tables of a kept run

With --timeline, pytest (tests/conftest.py) writes where and when each test starts, and a second
table gives the CPU per test file: a process goes to the file whose test ran on its worker when
it started.

`make test` is CPU-bound on 2 cores (both workers busy, the cores idle ~10 % of the time), so its
wall time follows the CPU work, wherever that runs: in pytest's workers, in ansible-playbook on
the controller, inside the rig's nodes (their sshd, systemd units, Slurm steps), in the trainer's
ranks. Linux writes one record per process when it exits, to the accounting file of its own PID
namespace and of every ancestor's, so one file here sees into every node. A process belongs to
the category of its nearest ancestor that names one (itself first): a trainer rank under a Slurm
step is the trainer's, an ansible module on a node is the node's sshd's.

The records are `struct acct_v3` (linux/acct.h, 64 bytes); times are comp_t (13-bit mantissa,
3-bit base-8 exponent) in AHZ ticks (100 per second). acct(2) needs root (CAP_SYS_PACCT), and a
PID namespace has one accounting file: this replaces any other for the run (then turns it off).
Processes still alive at the end (daemons of a rig torn down later) are not counted, and a
process cannot be placed while its parent lives: read the records once the command ended.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

RECORD = struct.Struct("=BBHIIIIIIf8H16s")  # struct acct_v3
ACCT_VERSION = 3
AHZ = 100
TOP_FILES = 30

# Nearest-ancestor rules, in the order they are tried on each process up the tree: (the start of
# its command name as the kernel keeps it, category). torchrun's agent takes the name of its
# last thread, pt_elastic; the ranks' threads pt_gloo_runloop/gloo_tcp_loop.
CATEGORIES = (
    ("pt_elastic", "trainer: torchrun and its ranks"),
    ("torchrun", "trainer: torchrun and its ranks"),
    ("slurmstepd", "nodes: Slurm job steps"),
    ("ansible-playboo", "controller: ansible-playbook (and local-connection modules)"),
    ("sshd", "nodes: over sshd (ansible modules, rlmctl host scripts)"),
    ("systemd", "nodes: daemons and timers (their systemd)"),
    ("podman", "podman"),
    ("conmon", "podman"),
    ("pip", "pip"),
    ("pytest", "tests: pytest, its workers and their subprocesses (rlmctl, trainer CLI)"),
)
OUTSIDE = "outside the tree: detached (rlmctl's launcher, daemons) or not a test's (lint)"
WORKERS = "(pytest's workers themselves)"
# tests/conftest.py appends a line per test here when it is set: {"pid", "test", "time"}.
TIMELINE_ENV = "RLM_TEST_TIMELINE"


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int  # its parent when it ended (a reaper's PID once its parent had died)
    comm: str
    cpu_s: float  # user + system
    start: float  # seconds since the epoch (whole seconds)
    end: float

    def could_have_started(self, child: Process) -> bool:
        """Whether this process was alive when `child` started (PIDs wrap at pid_max, 32768
        here, about every 12 minutes of `make test`)."""
        return self.start - 1 <= child.start <= self.end + 1


def comp_t(value: int) -> int:
    return (value & 0x1FFF) << (((value >> 13) & 0x7) * 3)


def read_records(data: bytes) -> Iterator[Process]:
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        fields = RECORD.unpack_from(data, offset)
        version = fields[1] & 0x7F  # the top bit marks a record written big-endian
        if version != ACCT_VERSION:
            raise ValueError(f"record at byte {offset}: version {version}, not acct_v3")
        pid, ppid, btime, etime = fields[6], fields[7], fields[8], fields[9]
        cpu = (comp_t(fields[10]) + comp_t(fields[11])) / AHZ
        comm = fields[18].split(b"\0", 1)[0].decode(errors="replace")
        yield Process(pid, ppid, comm, cpu, float(btime), btime + etime / AHZ)


def index_by_pid(processes: list[Process]) -> dict[int, list[Process]]:
    """Every record of each PID (`parent_of` tells a reused PID's processes apart)."""
    by_pid: dict[int, list[Process]] = collections.defaultdict(list)
    for process in processes:
        by_pid[process.pid].append(process)
    return by_pid


def categorise(processes: list[Process]) -> dict[str, list[Process]]:
    """Per category, its processes."""
    by_pid = index_by_pid(processes)
    out: dict[str, list[Process]] = collections.defaultdict(list)
    for process in processes:
        out[category_of(process, by_pid)].append(process)
    return dict(out)


def parent_of(process: Process, by_pid: dict[int, list[Process]]) -> Process | None:
    """The record of the process that was `process`'s parent: of those with its PID, the one
    alive when it started (None: the parent did not end while accounting was on)."""
    candidates = [p for p in by_pid.get(process.ppid, ()) if p.could_have_started(process)]
    return min(candidates, key=lambda p: process.start - p.start, default=None)


def category_of(process: Process, by_pid: dict[int, list[Process]]) -> str:
    current: Process | None = process
    for _ in range(64):  # deeper than any tree here; bounds a loop of mismatched records
        if current is None:
            break
        for prefix, category in CATEGORIES:
            if current.comm.startswith(prefix):
                return category
        current = parent_of(current, by_pid)
    return OUTSIDE


def table(processes: list[Process]) -> str:
    groups = categorise(processes)
    total = sum(p.cpu_s for p in processes) or 1.0
    lines = [f"{total / 60:.1f} CPU-min in {len(processes)} processes"]
    for category, members in sorted(groups.items(), key=lambda kv: -sum(p.cpu_s for p in kv[1])):
        cpu = sum(p.cpu_s for p in members)
        comms: dict[str, float] = collections.defaultdict(float)
        for p in members:
            comms[p.comm] += p.cpu_s
        heaviest = sorted(comms.items(), key=lambda kv: -kv[1])[:3]
        top = ", ".join(f"{name} {s / 60:.1f}" for name, s in heaviest)
        lines.append(
            f"{cpu / 60:7.1f} CPU-min {100 * cpu / total:5.1f} % {len(members):7d} processes"
            f"  {category}  [{top}]"
        )
    return "\n".join(lines)


def read_timeline(text: str) -> dict[int, list[tuple[float, str]]]:
    """Per pytest worker PID, (start time, test file) of its tests, in order."""
    out: dict[int, list[tuple[float, str]]] = collections.defaultdict(list)
    for line in text.splitlines():
        entry = json.loads(line)
        out[entry["pid"]].append((entry["time"], entry["test"].partition("::")[0]))
    for tests in out.values():
        tests.sort()
    return dict(out)


def by_test_file(
    processes: list[Process], timeline: dict[int, list[tuple[float, str]]]
) -> dict[str, float]:
    """CPU-seconds per test file: each process goes to the file whose test ran on its worker
    when it started (a module's fixture and daemons included; the session rig's sshd goes to
    the first file that used it, the commands run through it to the file that ran them)."""
    by_pid = index_by_pid(processes)
    out: dict[str, float] = collections.defaultdict(float)
    for process in processes:
        out[test_file_of(process, by_pid, timeline)] += process.cpu_s
    return dict(out)


def test_file_of(
    process: Process,
    by_pid: dict[int, list[Process]],
    timeline: dict[int, list[tuple[float, str]]],
) -> str:
    """The test file `process` belongs to: walking up to a child of a worker (a worker lives
    the whole run, so a parent PID that is a worker's is that worker, recorded or not yet)."""
    if process.pid in timeline:
        return WORKERS
    current: Process | None = process
    for _ in range(64):
        if current is None:
            break
        if current.ppid in timeline:
            tests = timeline[current.ppid]
            started = [test for when, test in tests if when <= process.start + 1]
            return started[-1] if started else WORKERS
        current = parent_of(current, by_pid)
    return OUTSIDE


def set_accounting(path: Path | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(str(path).encode() if path else None) != 0:
        error = ctypes.get_errno()
        raise SystemExit(f"error: acct(2) failed: {os.strerror(error)} (run as root)")


def file_table(processes: list[Process], timeline: dict[int, list[tuple[float, str]]]) -> str:
    per_file = sorted(by_test_file(processes, timeline).items(), key=lambda kv: -kv[1])
    return "\n".join(f"{cpu / 60:7.1f} CPU-min  {name}" for name, cpu in per_file[:TOP_FILES])


def report(path: Path, timeline: Path | None) -> str:
    processes = list(read_records(path.read_bytes()))
    text = table(processes)
    if timeline is not None and timeline.is_file():
        text += "\nby test file:\n" + file_table(processes, read_timeline(timeline.read_text()))
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--read", type=Path, help="summarise this accounting file")
    parser.add_argument("--keep", type=Path, help="where to keep the accounting file of the run")
    parser.add_argument("--timeline", type=Path, help=f"the tests' {TIMELINE_ENV} file")
    parser.add_argument("command", nargs="*", help="the command to run under accounting")
    args = parser.parse_args(argv)
    if args.read:
        if not args.read.is_file():
            raise SystemExit(f"error: no accounting file at {args.read}")
        print(report(args.read, args.timeline))
        return 0
    if not args.command:
        parser.error("give a command after --, or --read FILE")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "pacct"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        env = dict(os.environ)
        if args.timeline:
            args.timeline.write_text("")
            env[TIMELINE_ENV] = str(args.timeline.resolve())
        set_accounting(path)
        try:
            code = subprocess.call(args.command, env=env)
        finally:
            set_accounting(None)
        print(report(path, args.timeline), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Launcher logs of a run, read from the run directory on the shared filesystem."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import TextIO

from rlmctl.errors import RlmctlError
from rlmctl.registry import Registry
from runcontract.rundir import RunDir

FOLLOW_POLL_S = 0.5


def log_paths(registry: Registry, run: str, host: str | None) -> dict[str, Path]:
    run_dir = RunDir(registry.run(run)["run_dir"])
    hosts = [h["host"] for h in registry.hosts(run)]
    if not hosts and host is None:  # a Slurm job: one output file per job (all its nodes)
        return {p.stem: p for p in sorted(run_dir.path.glob("slurm-*.out"))}
    if host is not None:
        if host not in hosts:
            raise RlmctlError(f"run {run} has no host {host!r}; its hosts: {', '.join(hosts)}")
        hosts = [host]
    return {h: run_dir.launcher_log_path(h) for h in hosts}


def show(paths: dict[str, Path], lines: int, follow: bool, out: TextIO) -> None:
    """The last `lines` of each log, prefixed with the host when there are several; with
    `follow`, new lines as they arrive until interrupted."""
    prefix = len(paths) > 1
    offsets: dict[str, int] = {}
    for host, path in paths.items():
        try:
            with open(path, "rb") as f:
                tail = deque(f, maxlen=lines)
                offsets[host] = f.tell()
        except FileNotFoundError:
            tail, offsets[host] = deque(), 0
        for line in tail:
            _write(out, host if prefix else None, line)
    out.flush()
    while follow:
        for host, path in paths.items():
            try:
                with open(path, "rb") as f:
                    f.seek(offsets[host])
                    for line in f:
                        if not line.endswith(b"\n"):
                            break  # the writer is mid-line: read it whole next time
                        offsets[host] += len(line)
                        _write(out, host if prefix else None, line)
            except FileNotFoundError:
                continue
        out.flush()
        time.sleep(FOLLOW_POLL_S)  # tail -f cadence


def _write(out: TextIO, host: str | None, line: bytes) -> None:
    text = line.decode(errors="replace").rstrip("\n")
    out.write(f"{host} | {text}\n" if host else text + "\n")

"""Launcher logs of a run, read from the run directory on the shared filesystem (which files:
the backend's `log_paths`)."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import TextIO

FOLLOW_POLL_S = 0.5


def show(
    paths: dict[str, Path], lines: int, follow: bool, out: TextIO, as_json: bool = False
) -> None:
    """The last `lines` of each log, prefixed with the host when there are several; with
    `follow`, new lines as they arrive until interrupted. `as_json`: one JSON object per line,
    {"host": ..., "line": ...}."""
    prefix = len(paths) > 1
    write = _write_json if as_json else _write
    offsets: dict[str, int] = {}
    for host, path in paths.items():
        try:
            with open(path, "rb") as f:
                tail = deque(f, maxlen=lines)
                offsets[host] = f.tell()
        except FileNotFoundError:
            tail, offsets[host] = deque(), 0
        for line in tail:
            write(out, host if prefix or as_json else None, line)
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
                        write(out, host if prefix or as_json else None, line)
            except FileNotFoundError:
                continue
        out.flush()
        time.sleep(FOLLOW_POLL_S)  # tail -f cadence


def _write_json(out: TextIO, host: str | None, line: bytes) -> None:
    text = line.decode(errors="replace").rstrip("\n")
    out.write(json.dumps({"host": host, "line": text}) + "\n")


def _write(out: TextIO, host: str | None, line: bytes) -> None:
    text = line.decode(errors="replace").rstrip("\n")
    out.write(f"{host} | {text}\n" if host else text + "\n")

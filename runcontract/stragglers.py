"""Stragglers: every rank's step figures (ranks.json) and which ranks are persistently slower
than their peers.

The trainer's rank 0 (trainer/rankstats.py) rewrites `<run_dir>/ranks.json` every
`metrics.log_every` steps with the newest `KEEP_WINDOWS` windows of the current attempt: per rank
its host and, per window, its mean step time, data wait and collective wait (seconds). In
synchronous data parallelism the step time is the same on every rank (the slowest rank's); a
rank's *own* time, the step less its collective wait, is what differs: a slow rank computes or
loads longer and then hardly waits, its peers wait for it inside the collectives.

A rank is a straggler when its own time exceeds `1 + margin` times the median own time of its
peers in each of the newest `windows` windows (persistently, not one slow step). `rlmctl status`
shows stragglers, `rlmctl watch --exclude-stragglers` leaves their hosts out of the next restart,
and rlm-exporter exports the figures and the flag (`rlm_rank_*`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from runcontract.rundir import RunDir, read_json

RANKS_FILE = "ranks.json"
RANKS_FORMAT = 1
KEEP_WINDOWS = 8
DEFAULT_MARGIN = 0.2  # 20 % slower than the median of its peers
DEFAULT_WINDOWS = 3  # in each of the newest 3 windows (3 × metrics.log_every steps)


def ranks_path(run_dir: RunDir) -> Any:
    return run_dir.path / RANKS_FILE


@dataclass
class RankWindows:
    """ranks.json: the hosts of the ranks (rank order) and the newest windows of the attempt."""

    hosts: list[str]
    started: float  # when the attempt's trainer began recording
    windows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    def add(self, step: int, steps: int, table: list[list[float]]) -> None:
        """One window ending at `step` over `steps` steps; `table`: per rank (step, data, comm)
        mean seconds."""
        self.windows.append(
            {
                "step": step,
                "steps": steps,
                "time": time.time(),
                "step_s": [round(row[0], 6) for row in table],
                "data_s": [round(row[1], 6) for row in table],
                "comm_s": [round(row[2], 6) for row in table],
            }
        )
        del self.windows[:-KEEP_WINDOWS]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RANKS_FORMAT,
            "hosts": self.hosts,
            "started": self.started,
            "windows": self.windows,
        }

    def write(self, run_dir: RunDir) -> None:
        """Replace ranks.json (no fsync: a figure, not a record; readers see old or new)."""
        path = ranks_path(run_dir)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def read(cls, run_dir: RunDir) -> RankWindows | None:
        """ranks.json, or None when there is none (or it is not one this version reads)."""
        data = read_json(ranks_path(run_dir))
        if not isinstance(data, dict) or data.get("format") != RANKS_FORMAT:
            return None
        hosts = data.get("hosts")
        windows = data.get("windows")
        if not isinstance(hosts, list) or not isinstance(windows, list):
            return None
        world = len(hosts)
        good = [
            w
            for w in windows
            if isinstance(w, dict)
            and all(isinstance(w.get(k), list) and len(w[k]) == world for k in _COLUMNS)
        ]
        return cls([str(h) for h in hosts], float(data.get("started") or 0.0), good)


_COLUMNS = ("step_s", "data_s", "comm_s")


@dataclass(frozen=True)
class RankFigures:
    """One rank in one window: mean seconds per step."""

    rank: int
    host: str
    step_s: float
    data_s: float
    comm_s: float  # collective wait: its gradient collectives, waiting for peers included
    own_s: float  # step less collective wait: its compute and data loading
    ratio: float | None  # own time ÷ the median own time of its peers


def figures(ranks: RankWindows, window: int = -1) -> list[RankFigures]:
    """Every rank's figures in one window (default: the newest); empty without windows."""
    if not ranks.windows:
        return []
    w = ranks.windows[window]
    own = [max(0.0, s - c) for s, c in zip(w["step_s"], w["comm_s"], strict=True)]
    out = []
    for rank, host in enumerate(ranks.hosts):
        peers = own[:rank] + own[rank + 1 :]
        median = statistics.median(peers) if peers else None
        ratio = own[rank] / median if median else None
        out.append(
            RankFigures(
                rank,
                host,
                w["step_s"][rank],
                w["data_s"][rank],
                w["comm_s"][rank],
                own[rank],
                ratio,
            )
        )
    return out


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    ratio: float  # the smallest own-time ratio over the windows judged
    own_s: float  # in the newest window
    peers_s: float  # the peers' median own time in the newest window
    windows: int
    step: int  # the newest window's step

    def describe(self) -> str:
        return (
            f"rank {self.rank} on {self.host} is {self.ratio:.2f}x slower than its peers "
            f"({self.own_s * 1e3:.0f} ms vs {self.peers_s * 1e3:.0f} ms of own time per step, "
            f"{self.windows} windows to step {self.step})"
        )


def stragglers(
    ranks: RankWindows | None, margin: float = DEFAULT_MARGIN, windows: int = DEFAULT_WINDOWS
) -> list[Straggler]:
    """Ranks whose own time exceeds (1 + margin) × their peers' median in each of the newest
    `windows` windows; none while fewer windows exist or the world is a single rank."""
    if ranks is None or ranks.world_size < 2 or len(ranks.windows) < windows or windows < 1:
        return []
    judged = [figures(ranks, index) for index in range(-windows, 0)]
    out = []
    for rank, host in enumerate(ranks.hosts):
        ratios = [window[rank].ratio for window in judged]
        if any(r is None or r <= 1 + margin for r in ratios):
            continue
        newest = judged[-1][rank]
        peers = [f.own_s for f in judged[-1] if f.rank != rank]
        out.append(
            Straggler(
                rank=rank,
                host=host,
                ratio=min(r for r in ratios if r is not None),
                own_s=newest.own_s,
                peers_s=statistics.median(peers),
                windows=windows,
                step=int(ranks.windows[-1]["step"]),
            )
        )
    return out


def straggling_hosts(found: list[Straggler]) -> list[str]:
    return sorted({s.host for s in found})

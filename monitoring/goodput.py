"""rlm-exporter's goodput and straggler series, read from each run directory.

Goodput (runcontract.goodput) is folded incrementally: per run a `GoodputFold` and the byte
offsets it has read of events.jsonl and metrics.jsonl, so a refresh reads only what was appended
(a long run's metrics.jsonl is hundreds of MB; every node's exporter reads the same files).
Records are fed in time order once they are `SETTLE_S` old (the trainer and rlmctl append to
two files; a line can land a moment after a later one in the other file); the figures are as of
that horizon. A file that shrank (a run directory replaced) starts the fold again.

Per-rank series (ranks.json, runcontract.stragglers) are exported only for the ranks that run on
this exporter's host (named as the launcher names it, the inventory name, compared with this
host's name): every node's exporter reads every run, and 32768 ranks from 4096 exporters would be
millions of duplicate series. The straggler count per run is exported by every exporter, like
the other rlm_run_* series (rules collapse them with max by (run)).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from runcontract.goodput import PARTS, GoodputFold, order_key
from runcontract.records import Event, fold_state
from runcontract.stragglers import DEFAULT_MARGIN, DEFAULT_WINDOWS, RankWindows, figures, stragglers

SETTLE_S = 30.0


@dataclass
class _Tail:
    """New complete lines of one append-only file since the last read."""

    path: Path
    offset: int = 0

    def read(self) -> list[dict[str, Any]] | None:
        """The records appended since the last call; None when the file shrank (replaced)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:
            return None
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n") + 1  # a torn last line waits for its newline
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                out.append(record)
        return out


@dataclass
class _RunFold:
    events: _Tail
    metrics: _Tail
    fold: GoodputFold
    pending: list[tuple[float, int, int, Any]] = field(default_factory=list)
    all_events: list[Event] = field(default_factory=list)
    order: int = 0


class GoodputReader:
    """Per run directory, its goodput as of `SETTLE_S` ago, read incrementally."""

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        self.settle_s = settle_s
        self._runs: dict[Path, _RunFold] = {}
        self._lock = threading.Lock()

    def _fresh(self, path: Path) -> _RunFold:
        return _RunFold(
            _Tail(path / "events.jsonl"), _Tail(path / "metrics.jsonl"), GoodputFold(run=path.name)
        )

    def read(self, path: Path, now: float | None = None) -> dict[str, Any] | None:
        """The run's goodput (Goodput.to_dict) or None before its first attempt."""
        now = time.time() if now is None else now
        with self._lock:
            state = self._runs.get(path) or self._fresh(path)
            events, metrics = state.events.read(), state.metrics.read()
            if events is None or metrics is None:
                state = self._fresh(path)
                events, metrics = state.events.read() or [], state.metrics.read() or []
            self._runs[path] = state
        for record in events:
            event = Event.from_dict(record)
            state.all_events.append(event)
            state.pending.append((event.time, order_key(event), state.order, event))
            state.order += 1
        for record in metrics:
            if record.get("kind") in ("train", "val"):
                when = record.get("time")
                if isinstance(when, int | float):
                    state.pending.append((float(when), 1, state.order, record))
                    state.order += 1
        run_state = fold_state(state.all_events)
        active = run_state is not None and run_state.active
        # An ended run takes everything; an active one what has settled.
        horizon = now - self.settle_s if active else float("inf")
        state.pending.sort(key=lambda item: item[:3])
        settled = [item for item in state.pending if item[0] <= horizon]
        state.pending = state.pending[len(settled) :]
        for *_, item in settled:
            state.fold.feed(item)
        result = state.fold.result(horizon if active else None)
        return result.to_dict() if result.wall_s > 0 else None

    def add_to(self, snapshots: list[Any], run_roots: list[Path], run_dirs: list[Path]) -> None:
        """Set `goodput` and `ranks` of each visible run snapshot (found by name under the run
        roots, or among the run directories); the folds of runs no longer visible are dropped."""
        by_name = {p.name: p for p in run_dirs}
        paths = set()
        for snapshot in snapshots:
            path = by_name.get(snapshot.name) or next(
                (root / snapshot.name for root in run_roots if (root / snapshot.name).is_dir()),
                None,
            )
            if path is None:
                continue
            paths.add(path)
            try:
                snapshot.goodput = self.read(path)
                snapshot.ranks = rank_view(path)
            except OSError:  # unreadable now: no goodput series this time, the rest stays
                continue
        with self._lock:
            for path in set(self._runs) - paths:
                del self._runs[path]


def this_host() -> set[str]:
    name = socket.gethostname().lower()
    return {name, name.split(".")[0]}


def rank_view(
    path: Path, margin: float = DEFAULT_MARGIN, windows: int = DEFAULT_WINDOWS
) -> dict[str, Any] | None:
    """This host's ranks' newest figures and the run's stragglers, from ranks.json."""
    from runcontract.rundir import RunDir

    ranks = RankWindows.read(RunDir(path))
    if ranks is None or not ranks.windows:
        return None
    mine = this_host()
    found = stragglers(ranks, margin, windows)
    flagged = {s.rank for s in found}
    local = [
        f for f in figures(ranks) if f.host.lower() in mine or f.host.split(".")[0].lower() in mine
    ]
    return {
        "stragglers": len(found),
        "ranks": [vars(f) | {"straggler": f.rank in flagged} for f in local],
        "updated": ranks.windows[-1].get("time"),
    }


_RANK_GAUGES = {
    "step_s": ("rlm_rank_step_seconds", "Mean step time of the rank, newest metrics window"),
    "data_s": ("rlm_rank_data_wait_seconds", "Mean seconds per step loading its batch"),
    "comm_s": (
        "rlm_rank_collective_wait_seconds",
        "Mean seconds per step in its gradient collectives (waiting for peers included)",
    ),
    "own_s": ("rlm_rank_own_seconds", "Mean step time less collective wait: its own work"),
    "ratio": ("rlm_rank_slowness_ratio", "Own time over the median own time of its peers"),
}


# Goodput record key → gauge (labels: run).
_RUN_GAUGES = {
    "goodput": (
        "rlm_run_goodput_ratio",
        "Share of the run's wall time spent in steps that were kept (runcontract.goodput)",
    ),
    "wall_s": ("rlm_run_wall_seconds", "Wall time of the run so far (first attempt on)"),
    "interruptions": ("rlm_run_interruptions", "Attempts ended by a failure or a preemption"),
    "restart_cost_s": (
        "rlm_run_restart_cost_seconds",
        "Mean failure detection + waiting + startup of each restart",
    ),
    "at_risk_s": (
        "rlm_run_at_risk_seconds",
        "Kept step time since the newest checkpoint: what a failure now would lose",
    ),
}


def families(runs: list[Any]) -> Iterator[Metric]:
    """The series of `runs` (RunSnapshot-like: `name`, `goodput`, `ranks`)."""
    run_gauges = {
        key: GaugeMetricFamily(name, doc, labels=["run"])
        for key, (name, doc) in _RUN_GAUGES.items()
    }
    parts = GaugeMetricFamily(
        "rlm_run_time_seconds",
        "Seconds of the run's wall time per part; the parts add up to rlm_run_wall_seconds",
        labels=["run", "part"],
    )
    count = GaugeMetricFamily(
        "rlm_run_stragglers", "Ranks persistently slower than their peers", labels=["run"]
    )
    rank_labels = ["run", "rank", "rank_host"]
    flag = GaugeMetricFamily(
        "rlm_rank_straggler",
        "1 when the rank is persistently slower than its peers (runcontract.stragglers)",
        labels=rank_labels,
    )
    rank_gauges = {
        key: GaugeMetricFamily(name, doc, labels=rank_labels)
        for key, (name, doc) in _RANK_GAUGES.items()
    }
    for run in runs:
        g = getattr(run, "goodput", None)
        if g:
            for key, family in run_gauges.items():
                if g.get(key) is not None:
                    family.add_metric([run.name], g[key])
            for part in PARTS:
                parts.add_metric([run.name, part], g["parts"][part])
        view = getattr(run, "ranks", None)
        if view:
            count.add_metric([run.name], view["stragglers"])
            for rank in view["ranks"]:
                labels = [run.name, str(rank["rank"]), rank["host"]]
                flag.add_metric(labels, 1.0 if rank["straggler"] else 0.0)
                for key, family in rank_gauges.items():
                    if rank.get(key) is not None:
                        family.add_metric(labels, rank[key])
    yield from run_gauges.values()
    yield from (parts, count, flag)
    yield from rank_gauges.values()

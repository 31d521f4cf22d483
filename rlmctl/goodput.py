"""Goodput in rlmctl: what `status`, `accept`, `plan` and `watch` show and decide from it.

The accounting itself is the run contract's (runcontract.goodput: where every second of the run's
wall time went; runcontract.stragglers: ranks slower than their peers; runcontract.interval:
Young/Daly's checkpoint interval). Here: the cluster's failure history from the registry, the
interval `watch --checkpoint-interval auto` applies on a restart, the go-live criterion, the
checkpoint-interval section of `plan`, and the lines `status` prints.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from clusterspec.variables import default
from runcontract.config import load_config
from runcontract.errors import UserError
from runcontract.goodput import PARTS, Goodput, goodput
from runcontract.interval import (
    SEED_MAX_INTERVAL_STEPS,
    Exposure,
    IntervalChoice,
    choose_interval,
    duration,
    expected_goodput,
    exposure,
    young_daly_seconds,
)
from runcontract.rundir import RunDir
from runcontract.states import EventKind
from runcontract.stragglers import RankWindows, Straggler, figures, stragglers

HOUR = 3600.0
# The order and the words of the parts on one screen.
PART_LABELS = {
    "productive": "productive",
    "startup": "startup",
    "checkpoint_stall": "checkpoint stall",
    "evaluation": "evaluation",
    "lost_work": "lost work",
    "detection": "failure detection",
    "waiting": "waiting",
    "unaccounted": "unaccounted",
}
assert tuple(PART_LABELS) == PARTS


def current_ranks(run: RunDir) -> RankWindows | None:
    """ranks.json when the newest attempt wrote it (an older attempt's figures are history)."""
    ranks = RankWindows.read(run)
    launched = [e.time for e in run.events() if e.kind == EventKind.LAUNCHED]
    if ranks is None or (launched and ranks.started < launched[-1]):
        return None
    return ranks


def run_view(run: RunDir, margin: float, windows: int) -> dict[str, Any]:
    """What `status` adds for a run: its goodput and its stragglers (JSON-ready)."""
    ranks = current_ranks(run)
    found = stragglers(ranks, margin, windows)
    return {
        "goodput": goodput(run).to_dict(),
        "stragglers": [vars(s) | {"describe": s.describe()} for s in found],
        "ranks": [vars(f) for f in figures(ranks)] if ranks else [],
    }


def lines(view: dict[str, Any] | None) -> list[str]:
    """The goodput and straggler lines of `rlmctl status`."""
    if not view:
        return []
    g = view["goodput"]
    out = []
    if g["wall_s"] > 0:
        ratio = g["goodput"] or 0.0
        parts = "  ".join(
            f"{PART_LABELS[k]} {100 * v / g['wall_s']:.1f}%"
            for k, v in g["parts"].items()
            if k != "productive" and v > 0
        )
        out.append(
            f"goodput {100 * ratio:.1f}% of {duration(g['wall_s'])} wall; lost: {parts or 'none'}"
        )
        out.append(
            f"attempts {g['attempts']} (failures {g['failures']}, preemptions "
            f"{g['preemptions']}), steps lost {g['steps_lost']}, restart cost "
            f"{duration(g['restart_cost_s'])}, a failure now loses {duration(g['at_risk_s'])}"
        )
    for s in view["stragglers"]:
        out.append(f"straggler: {s['describe']} (rlmctl watch --exclude-stragglers)")
    return out


# the go-live criterion ----------------------------------------------------------------------------
def criterion(run: RunDir, thresholds: dict[str, Any]) -> tuple[str, str, str, str]:
    """(threshold, measured, verdict, reason) of the goodput criterion of `rlmctl accept`."""
    limit = float(thresholds["goodput_min_pct"])
    minimum_s = float(thresholds["goodput_min_wall_s"])
    g = goodput(run)
    threshold = f">= {limit:g} % of wall time (runs >= {duration(minimum_s)})"
    if g.wall_s <= 0 or g.ratio is None:
        return threshold, "-", "NO DATA", "no attempt recorded yet"
    lost = sorted(
        ((k, v) for k, v in g.parts.items() if k != "productive" and v > 0),
        key=lambda kv: -kv[1],
    )
    biggest = ", ".join(f"{PART_LABELS[k]} {100 * v / g.wall_s:.1f}%" for k, v in lost[:3])
    measured = f"{100 * g.ratio:.1f} % of {duration(g.wall_s)}"
    if g.wall_s < minimum_s:
        return threshold, measured, "NO DATA", f"run shorter than {duration(minimum_s)}: {biggest}"
    verdict = "PASS" if 100 * g.ratio >= limit else "FAIL"
    return threshold, measured, verdict, biggest if verdict == "FAIL" else ""


# the checkpoint interval --------------------------------------------------------------------------
def cluster_exposure(run_dirs: Iterable[RunDir], now: float | None = None) -> Exposure:
    """Failures over node-seconds of every run of the registry (from their events)."""
    total = Exposure()
    for run in run_dirs:
        try:
            total = total + exposure(run.events(), now)
        except OSError:  # a run directory that went away: its history is not ours to judge
            continue
    return total


def attempt_nodes(run: RunDir) -> int:
    """Nodes of the run's newest attempt (its `launched` event), 1 when unknown."""
    for event in reversed(run.events()):
        if event.kind == EventKind.LAUNCHED:
            hosts = event.fields.get("hosts") or []
            return int(event.fields.get("nodes") or len(hosts) or 1)
    return 1


@dataclass(frozen=True)
class Measured:
    """What a run's directory says of its checkpoint cost and speed."""

    step_time_s: float | None
    stall_s: float | None
    write_s: float | None
    restart_s: float | None
    async_save: bool
    interval_steps: int | None


def measured(run: RunDir, g: Goodput | None = None) -> Measured:
    g = g or goodput(run)
    try:
        cfg = load_config(run.config_path, current_overrides(run))
        async_save, interval = cfg.checkpoint.async_save, cfg.checkpoint.interval_steps
    except (OSError, UserError):
        async_save, interval = False, None
    return Measured(
        g.step_time_s,
        g.checkpoint_stall_s,
        g.checkpoint_write_s,
        g.restart_cost_s,
        async_save,
        interval,
    )


def _checkpoint_shape(run: RunDir) -> tuple[Any, ...] | None:
    """What a save's cost depends on: the model and the checkpoint format (from config.yaml)."""
    import yaml

    try:
        cfg = yaml.safe_load(run.config_path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return None
    ckpt = cfg.get("checkpoint") or {}
    return (
        json.dumps(cfg.get("model"), sort_keys=True),
        ckpt.get("format"),
        ckpt.get("async_save"),
    )


def _modified(run: RunDir) -> float:
    try:
        return run.events_path.stat().st_mtime
    except OSError:
        return 0.0


def like_measured(run: RunDir, own: Measured, others: list[RunDir]) -> Measured:
    """`own` with the stall and step time it lacks taken from the newest other run of the same
    model and checkpoint settings that measured them."""
    shape = _checkpoint_shape(run)
    for other in sorted(others, key=_modified, reverse=True):
        if shape is None or _checkpoint_shape(other) != shape:
            continue
        theirs = measured(other)
        if theirs.stall_s is None:
            continue
        return dataclasses.replace(
            own,
            stall_s=own.stall_s if own.stall_s is not None else theirs.stall_s,
            step_time_s=own.step_time_s if own.step_time_s is not None else theirs.step_time_s,
            write_s=own.write_s if own.write_s is not None else theirs.write_s,
        )
    return own


def auto_interval(
    run: RunDir,
    history: Iterable[RunDir],
    max_steps: int,
    nodes: int | None = None,
) -> tuple[IntervalChoice, Exposure]:
    """The interval `watch --checkpoint-interval auto` applies: Young/Daly from the failure rate
    of this run and of the registry's other runs, and this run's measured stall and step time."""
    now = time.time()
    mine = exposure(run.events(), now)
    others = cluster_exposure((r for r in history if r.path != run.path), now)
    seen = mine + others
    nodes = nodes or attempt_nodes(run)
    job_mtbf = seen.node_mtbf_s / nodes if seen.node_mtbf_s else None
    m = measured(run)
    if m.stall_s is None or m.step_time_s is None:
        # No save (or step) of its own yet, e.g. failing before its first checkpoint: a run of
        # the same model and checkpoint settings in the registry measured what it costs.
        m = like_measured(run, m, [r for r in history if r.path != run.path])
    choice = choose_interval(
        step_time_s=m.step_time_s,
        stall_s=m.stall_s,
        job_mtbf_s=job_mtbf,
        restart_s=m.restart_s or 0.0,
        write_s=m.write_s or 0.0,
        async_save=m.async_save,
        max_steps=max_steps,
    )
    return choice, seen


def golive_max_interval(thresholds: dict[str, Any] | None) -> int:
    merged = default("rlm_accept_thresholds") | (thresholds or {})
    return int(merged["checkpoint_max_interval"])


def interval_cap(requested: int | None, thresholds: dict[str, Any] | None) -> int:
    """The most steps between checkpoints auto may pick: the seed's 1000 unless asked otherwise,
    never beyond the go-live limit (accept would fail the run)."""
    limit = golive_max_interval(thresholds)
    return min(requested or SEED_MAX_INTERVAL_STEPS, limit)


def current_overrides(run: RunDir) -> list[str]:
    """The config overrides later attempts of the run get: the newest interval watch chose."""
    for event in reversed(run.events()):
        if event.kind == EventKind.CHECKPOINT_INTERVAL:
            steps = event.fields.get("steps")
            if isinstance(steps, int) and steps > 0:
                return [f"checkpoint.interval_steps={steps}"]
            return []
    return []


def record_choice(
    run: RunDir, choice: IntervalChoice, seen: Exposure, previous: int | None
) -> None:
    run.append_event(
        EventKind.CHECKPOINT_INTERVAL,
        previous=previous,
        failures=seen.failures,
        node_hours=round(seen.node_seconds / HOUR, 4),
        node_mtbf_s=seen.node_mtbf_s,
        **choice.as_dict(),
    )


@dataclass(frozen=True)
class IntervalPlan:
    """`rlmctl plan --nodes N --node-mtbf-hours H`: the checkpoint interval and its goodput."""

    nodes: int
    node_mtbf_h: float
    job_mtbf_s: float
    stall_s: float
    restart_s: float
    write_s: float
    optimum_s: float
    expected_goodput: float
    step_time_s: float | None
    choice: IntervalChoice | None
    alternatives: dict[int, float]  # steps -> expected goodput
    max_steps: int
    source: str  # where the measured figures came from

    def as_dict(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["choice"] = self.choice.as_dict() if self.choice else None
        return out

    def lines(self) -> list[str]:
        out = [
            f"{self.nodes} node(s) at a per-node MTBF of {self.node_mtbf_h:g} h: the job fails "
            f"every {duration(self.job_mtbf_s)} on average",
            f"checkpoint stall {self.stall_s:.3g} s, restart {duration(self.restart_s)} "
            f"({self.source}): Young/Daly sqrt(2 x stall x MTBF) = {duration(self.optimum_s)} "
            f"of training between checkpoints, expected goodput "
            f"{100 * self.expected_goodput:.1f}%",
        ]
        if self.choice is not None and self.step_time_s:
            bound = f" (held at the {self.choice.bound} bound)" if self.choice.bound else ""
            out.append(
                f"at {self.step_time_s:.3g} s per step: checkpoint.interval_steps="
                f"{self.choice.steps}{bound}, expected goodput "
                f"{100 * (self.choice.expected_goodput or 0):.1f}% (at most {self.max_steps} "
                "steps: the seed's limit; the go-live limit is "
                f"{golive_max_interval(None)})"
            )
            for steps, model in self.alternatives.items():
                out.append(f"  every {steps} steps instead: expected goodput {100 * model:.1f}%")
        else:
            out.append("give --step-time (or --from-run RUN) for the interval in steps")
        return out


def plan_interval(
    nodes: int,
    node_mtbf_h: float,
    stall_s: float,
    restart_s: float = 0.0,
    step_time_s: float | None = None,
    write_s: float = 0.0,
    async_save: bool = False,
    max_steps: int = SEED_MAX_INTERVAL_STEPS,
    source: str = "given",
) -> IntervalPlan:
    job_mtbf = node_mtbf_h * HOUR / nodes
    optimum = young_daly_seconds(stall_s, job_mtbf)
    choice = None
    alternatives: dict[int, float] = {}
    if step_time_s:
        choice = choose_interval(
            step_time_s=step_time_s,
            stall_s=stall_s,
            job_mtbf_s=job_mtbf,
            restart_s=restart_s,
            write_s=write_s,
            async_save=async_save,
            max_steps=max_steps,
        )
        for steps in sorted({max(1, (choice.steps or 1) // 4), (choice.steps or 1) * 4, max_steps}):
            if steps != choice.steps:
                interval = steps * step_time_s
                alternatives[steps] = expected_goodput(
                    interval, stall_s, job_mtbf, restart_s, write_s
                )
    return IntervalPlan(
        nodes=nodes,
        node_mtbf_h=node_mtbf_h,
        job_mtbf_s=job_mtbf,
        stall_s=stall_s,
        restart_s=restart_s,
        write_s=write_s,
        optimum_s=optimum,
        expected_goodput=expected_goodput(optimum, stall_s, job_mtbf, restart_s, write_s),
        step_time_s=step_time_s,
        choice=choice,
        alternatives=alternatives,
        max_steps=max_steps,
        source=source,
    )


def straggler_exclusions(run: RunDir, margin: float, windows: int) -> list[Straggler]:
    return stragglers(current_ranks(run), margin, windows)

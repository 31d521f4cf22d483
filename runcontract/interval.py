"""The checkpoint interval from measured failures: Young/Daly's first-order optimum.

A job of N nodes whose nodes fail independently at a rate λ per node-second fails every
M = 1 / (λ N) seconds on average (its MTBF). Checkpointing every τ seconds of training costs the
checkpoint stall δ per save (a sync save's whole time; an async save's call and its wait for the
copy to host memory) and, per failure, the work since the newest durable checkpoint (τ/2 on
average, plus an async save's write w still in flight) and the restart R (detection, waiting,
startup). To first order the share of wall time that is lost is

    δ/τ + (τ/2 + w + R) / M,

which is smallest at τ* = √(2 δ M) (Young 1974, Daly 2006), where the expected goodput is
1 − √(2δ/M) − (w + R)/M. In steps: τ*/step time, bounded above by the interval the run may not
exceed (the seed's ≤ 1000 steps by default, never beyond the go-live limit, rlm_accept_thresholds'
`checkpoint_max_interval`) and below by an async save's write (a save must not wait for the one
before it). λ is measured: failures over node-seconds of this run's attempts and of every run in
the cluster's registry (`exposure`), from the events alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from runcontract.exitcodes import restartable
from runcontract.records import Event
from runcontract.states import EventKind

SEED_MAX_INTERVAL_STEPS = 1000  # the seed: a checkpoint at least every 1000 steps
# The events that end an attempt (the first one closes its node-seconds).
_ENDS = frozenset(
    {
        EventKind.EXIT,
        EventKind.START_REFUSED,
        EventKind.LAUNCH_FAILED,
        EventKind.FAILURE,
        EventKind.STOPPED,
        EventKind.GAVE_UP,
    }
)


@dataclass(frozen=True)
class Exposure:
    """Failures seen over node-seconds of attempts (the input of a failure rate)."""

    failures: int = 0
    node_seconds: float = 0.0

    def __add__(self, other: Exposure) -> Exposure:
        return Exposure(self.failures + other.failures, self.node_seconds + other.node_seconds)

    @property
    def node_mtbf_s(self) -> float | None:
        """Mean node-seconds between failures; None before the first failure."""
        return self.node_seconds / self.failures if self.failures else None


def exposure(events: Iterable[Event], now: float | None = None) -> Exposure:
    """Failures (attempts ended by a restartable failure: a crash, a lost host, a hang; not a
    config or data error, a stop or a preemption) and node-seconds (each attempt from its
    `launched` to its end, times its node count) of one run's events. `now`: the newest
    attempt is still running."""
    failures, node_seconds = 0, 0.0
    opened: float | None = None  # the newest attempt's launch, until its first end
    inside = failed = False  # inside an attempt; it already counted as a failure
    nodes = 1
    for event in events:
        kind = event.known_kind
        if kind is EventKind.LAUNCHED:
            if opened is not None:  # the previous attempt ended without a word: a crash
                node_seconds += (event.time - opened) * nodes
                failures += 0 if failed else 1
            opened, inside, failed = event.time, True, False
            hosts = event.fields.get("hosts") or []
            nodes = int(event.fields.get("nodes") or len(hosts) or 1)
        elif kind in _ENDS and inside:
            if opened is not None:
                node_seconds += (event.time - opened) * nodes
                opened = None
            if not failed and _ends_badly(event):
                failures += 1
                failed = True
    if opened is not None and now is not None:
        node_seconds += max(0.0, now - opened) * nodes
    return Exposure(failures, node_seconds)


def _ends_badly(event: Event) -> bool:
    """An attempt's end that counts as a failure of the nodes (not of the input)."""
    kind, code = event.known_kind, event.exit_code
    if kind is EventKind.FAILURE:
        return not event.fields.get("preempted") and restartable(code)
    if kind in (EventKind.STOPPED, EventKind.GAVE_UP):
        return False
    return code not in (0, None) and restartable(code)


def duration(seconds: float | None) -> str:
    """Seconds as an operator reads them: 42.0 s, 12.5 min, 3.2 h."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def young_daly_seconds(stall_s: float, mtbf_s: float) -> float:
    """Young/Daly's first-order optimum: seconds of training between checkpoints."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def expected_goodput(
    interval_s: float, stall_s: float, mtbf_s: float, restart_s: float = 0.0, write_s: float = 0.0
) -> float:
    """First-order share of wall time that is kept training, checkpointing every
    `interval_s` seconds of training (clipped at 0)."""
    if interval_s <= 0 or mtbf_s <= 0:
        return 0.0
    lost = stall_s / interval_s + (interval_s / 2 + write_s + restart_s) / mtbf_s
    return max(0.0, 1.0 - lost)


@dataclass(frozen=True)
class IntervalChoice:
    """The checkpoint interval the measurements call for, or why there is none."""

    steps: int | None  # None: keep the configured interval
    reason: str  # one line: what it is based on, or why there is none
    optimum_s: float | None = None  # Young/Daly, unbounded
    optimum_steps: float | None = None
    bound: str | None = None  # "max" or "async write" when the optimum was clamped
    job_mtbf_s: float | None = None
    stall_s: float | None = None
    step_time_s: float | None = None
    expected_goodput: float | None = None  # the first-order model at `steps`

    def as_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "reason": self.reason,
            "optimum_s": self.optimum_s,
            "optimum_steps": self.optimum_steps,
            "bound": self.bound,
            "job_mtbf_s": self.job_mtbf_s,
            "stall_s": self.stall_s,
            "step_time_s": self.step_time_s,
            "expected_goodput": self.expected_goodput,
        }


def choose_interval(
    *,
    step_time_s: float | None,
    stall_s: float | None,
    job_mtbf_s: float | None,
    restart_s: float = 0.0,
    write_s: float = 0.0,
    async_save: bool = False,
    max_steps: int = SEED_MAX_INTERVAL_STEPS,
) -> IntervalChoice:
    """The interval in steps that maximises the expected goodput, within [the async write's
    steps, `max_steps`]; `steps` None with the reason when a measurement is missing."""
    missing = [
        what
        for what, value in (
            ("a failure rate (no failure seen yet)", job_mtbf_s),
            ("a step time (no step recorded)", step_time_s),
            ("a checkpoint stall (no save recorded)", stall_s),
        )
        if not value or value <= 0
    ]
    if missing:
        return IntervalChoice(None, f"no measured {missing[0]}; the configured interval stays")
    assert step_time_s and stall_s and job_mtbf_s
    optimum = young_daly_seconds(stall_s, job_mtbf_s)
    steps_f = optimum / step_time_s
    floor = max(1, math.ceil(write_s / step_time_s)) if async_save else 1
    steps, bound = round(steps_f), None
    if steps > max_steps:
        steps, bound = max_steps, "max"
    if steps < floor:
        steps, bound = floor, "async write" if async_save and floor > 1 else None
    steps = max(1, steps)
    model = expected_goodput(steps * step_time_s, stall_s, job_mtbf_s, restart_s, write_s)
    clamp = f", held at the {bound} bound" if bound else ""
    reason = (
        f"Young/Daly: sqrt(2 x {stall_s:.3g} s stall x {duration(job_mtbf_s)} job MTBF) = "
        f"{duration(optimum)} = {steps_f:.0f} steps of {step_time_s:.3g} s{clamp}"
    )
    return IntervalChoice(
        steps,
        reason,
        optimum_s=optimum,
        optimum_steps=steps_f,
        bound=bound,
        job_mtbf_s=job_mtbf_s,
        stall_s=stall_s,
        step_time_s=step_time_s,
        expected_goodput=model,
    )

"""Goodput: where every second of a run's wall time went, from its run directory alone.

The run's wall time (its first `launched` or `start` event to its last record, or now while it is
active) is split into parts that add up to it exactly:

| part | what |
|---|---|
| productive | optimizer steps whose progress was kept (the trainer's own per-step bookkeeping included) |
| startup | launch (or a trainer start without one) to the first step: rendezvous, model build, checkpoint load, and the first step's excess over an ordinary step (compilation, warm-up) |
| checkpoint_stall | time the loop was blocked by checkpoint saves: a sync save whole, an async save's call and its wait for the copy to host memory (the trainer's `checkpoint_stall`) |
| evaluation | validation passes (the trainer's `seconds` of each `val` record) |
| lost_work | steps done again after a restart or a rollback: from the step the next attempt resumed from (its `start` event) to the last step before the failure, with their stalls and evaluations; and the reload of a rollback |
| detection | from the last step of an attempt that failed to the moment its end was recorded: a crash seen by the trainer's exit or by `rlmctl watch`'s poll, a hang by `--stall` |
| waiting | between attempts: stopping the rest of a failed job, back-off, the health gate, a scheduler's queue |
| unaccounted | what the records do not explain: gaps between steps beyond the step, its stall and evaluation; the trainer's shutdown; the time since the last step while a run is active, beyond two ordinary steps |

`goodput = productive / wall`. Sources: events.jsonl (attempts: `launched`, `start` with the step
it resumed from, `exit`, `start_refused`, `launch_failed`, `failure`, `rollback`, `checkpoint`,
`stopped`, `gave_up`) and metrics.jsonl (`train` records: `time`, `step`, `step_time`,
`checkpoint_stall`; `val` records: `seconds`). Standard library only; `GoodputFold` consumes the
records in time order, so a long-lived reader (the exporter) can feed it incrementally.
"""

from __future__ import annotations

import statistics
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from runcontract.records import Event, fold_state
from runcontract.rundir import RunDir, read_jsonl
from runcontract.states import EventKind, RunState

PARTS = (
    "productive",
    "startup",
    "checkpoint_stall",
    "evaluation",
    "lost_work",
    "detection",
    "waiting",
    "unaccounted",
)
# The parts a kept step carries; a restart or rollback moves them into lost_work.
STEP_PARTS = ("productive", "checkpoint_stall", "evaluation", "unaccounted")
# While a run is active, the time since its last step is a step in progress up to this many
# ordinary steps; beyond that it is unaccounted (a hang shows up there before watch sees it).
OPEN_STEP_ALLOWANCE = 2.0


class Phase(Enum):
    IDLE = auto()  # before the first attempt
    LAUNCHING = auto()  # an attempt was launched; no trainer has started yet
    STARTED = auto()  # the trainer started (its `start` event); no step yet
    TRAINING = auto()  # steps are being recorded
    ENDED_OK = auto()  # the attempt ended cleanly (done, stopped, preempted after a save)
    ENDED_FAILED = auto()  # the attempt ended in a failure
    WAITING = auto()  # the failure was recorded; waiting for the next attempt


ACTIVE_PHASES = (Phase.LAUNCHING, Phase.STARTED, Phase.TRAINING)


@dataclass(frozen=True)
class Goodput:
    """The accounting of one run; `parts` (seconds) add up to `wall_s`."""

    run: str
    wall_s: float
    parts: dict[str, float]
    start: float | None  # unix time the run's first attempt began
    end: float | None  # its last record, or now while it is active
    active: bool
    attempts: int
    failures: int  # attempts that ended in a failure
    preemptions: int  # attempts stopped on a signal nobody asked for, after a save
    rollbacks: int
    steps_kept: int
    steps_lost: int
    step_time_s: float | None  # median step time
    checkpoints: int  # checkpoint saves
    checkpoint_stall_s: float | None  # mean stall per save
    checkpoint_write_s: float | None  # median write time of a save (async: in the background)
    first_startup_s: float  # the startup of the first attempt
    restart_cost_s: float | None  # mean detection + waiting + startup of each later attempt
    lost_per_failure_s: float | None
    at_risk_s: float  # kept step time since the newest checkpoint: what a failure now would lose

    @property
    def ratio(self) -> float | None:
        return self.parts["productive"] / self.wall_s if self.wall_s > 0 else None

    @property
    def interruptions(self) -> int:
        return self.failures + self.preemptions

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "goodput": self.ratio,
            "wall_s": self.wall_s,
            "parts": dict(self.parts),
            "shares": {
                k: (v / self.wall_s if self.wall_s > 0 else None) for k, v in self.parts.items()
            },
            "start": self.start,
            "end": self.end,
            "active": self.active,
            "attempts": self.attempts,
            "interruptions": self.interruptions,
            "failures": self.failures,
            "preemptions": self.preemptions,
            "rollbacks": self.rollbacks,
            "steps_kept": self.steps_kept,
            "steps_lost": self.steps_lost,
            "step_time_s": self.step_time_s,
            "checkpoints": self.checkpoints,
            "checkpoint_stall_s": self.checkpoint_stall_s,
            "checkpoint_write_s": self.checkpoint_write_s,
            "first_startup_s": self.first_startup_s,
            "restart_cost_s": self.restart_cost_s,
            "lost_per_failure_s": self.lost_per_failure_s,
            "at_risk_s": self.at_risk_s,
        }


class Lineage:
    """The kept steps, oldest first, with the cumulative seconds of each step part: a restart
    or rollback cuts it back to the step it resumed from in O(log n)."""

    def __init__(self) -> None:
        self.steps = array("q")
        self.cumulative = {part: array("d") for part in STEP_PARTS}

    def __len__(self) -> int:
        return len(self.steps)

    def total(self, part: str) -> float:
        values = self.cumulative[part]
        return values[-1] if values else 0.0

    def append(self, step: int, seconds: dict[str, float]) -> None:
        self.steps.append(step)
        for part, values in self.cumulative.items():
            values.append((values[-1] if values else 0.0) + seconds.get(part, 0.0))

    def move_last(self, part: str, to_part_seconds: float) -> None:
        """Take `to_part_seconds` off the newest step's `part` (the caller books it elsewhere)."""
        self.cumulative[part][-1] -= to_part_seconds

    def cut_after(self, step: int) -> tuple[int, float]:
        """Drop every step after `step`; (steps dropped, their seconds)."""
        keep = bisect_right(self.steps, step)
        dropped = len(self.steps) - keep
        if not dropped:
            return 0, 0.0
        seconds = 0.0
        for values in self.cumulative.values():
            before = values[keep - 1] if keep else 0.0
            seconds += values[-1] - before
            del values[keep:]
        del self.steps[keep:]
        return dropped, seconds

    def seconds_after(self, step: int) -> float:
        keep = bisect_right(self.steps, step)
        total = 0.0
        for values in self.cumulative.values():
            if values:
                total += values[-1] - (values[keep - 1] if keep else 0.0)
        return total


@dataclass
class _FirstStep:
    """An attempt's first step, split into startup and a productive ordinary step once the
    attempt's second step says how long an ordinary step is."""

    step: int
    step_time: float
    booked: float  # productive seconds booked for it so far


@dataclass
class GoodputFold:
    """Consumes a run's events and metric records in time order (`feed`); `result` at any
    point. Items: `Event`s and metric records (dicts with `kind` train or val)."""

    run: str = ""
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    lineage: Lineage = field(default_factory=Lineage)
    phase: Phase = Phase.IDLE
    origin: float | None = None
    cursor: float | None = None  # the wall time is booked up to here
    last_time: float | None = None  # the newest item fed
    attempts: int = 0
    failures: int = 0
    preemptions: int = 0
    rollbacks: int = 0
    steps_lost: int = 0
    checkpoint_steps: list[int] = field(default_factory=list)
    checkpoint_writes: list[float] = field(default_factory=list)
    stall_total: float = 0.0
    first_startup: float | None = None
    step_times: array[float] = field(default_factory=lambda: array("d"))
    _first: _FirstStep | None = None
    _pending_eval: float = 0.0
    _stop_asked: bool = False  # an operator asked this attempt to stop
    _attempt_failed: bool = False
    _attempt_startup: float = 0.0

    # feeding ------------------------------------------------------------------------------------
    def feed(self, item: Event | dict[str, Any]) -> None:
        when = _time_of(item)
        self.last_time = when if self.last_time is None else max(self.last_time, when)
        if isinstance(item, Event):
            self._event(item)
        elif item.get("kind") == "train":
            self._train(item)
        elif item.get("kind") == "val":
            seconds = _number(item.get("seconds"))
            self._pending_eval += seconds or 0.0

    def _book(self, part: str, until: float) -> None:
        """The time from the cursor to `until` goes to `part`."""
        if self.cursor is None:
            self.origin = self.cursor = until
            return
        seconds = max(0.0, until - self.cursor)
        self.totals[part] += seconds
        if part == "startup":
            self._attempt_startup += seconds
        self.cursor = max(self.cursor, until)

    def _open_attempt(self, when: float) -> None:
        """A new attempt begins at `when`: what lay between is detection or waiting."""
        if self.phase in (Phase.ENDED_FAILED, Phase.TRAINING):
            self._book("detection", when)
        elif self.phase in (Phase.LAUNCHING, Phase.STARTED):
            self._book("startup", when)  # a start that never got anywhere
        else:
            self._book("waiting", when)
        self._close_attempt()
        self.attempts += 1
        self._stop_asked = self._attempt_failed = False
        self._attempt_startup = 0.0
        self.phase = Phase.LAUNCHING

    def _close_attempt(self) -> None:
        """Book the end of the current attempt (its first step settled, its startup noted)."""
        self._settle_first(None)
        ended_silently = self.phase in ACTIVE_PHASES and self.attempts
        if ended_silently and not self._attempt_failed:
            self.failures += 1  # it ended without saying how: a crash, a lost host
            self._attempt_failed = True
        if self.first_startup is None and self.attempts:
            self.first_startup = self._attempt_startup

    def _event(self, event: Event) -> None:
        kind, when = event.known_kind, event.time
        if kind is EventKind.LAUNCHED:
            self._open_attempt(when)
        elif kind is EventKind.START:
            if self.phase is Phase.LAUNCHING:
                self._book("startup", when)
            else:  # a trainer started without a launch record (by hand, an old Slurm requeue)
                self._open_attempt(when)
            self.phase = Phase.STARTED
            resumed = event.fields.get("step")
            if isinstance(resumed, int):
                self._cut(resumed)
        elif kind is EventKind.EXIT:
            self._trainer_exit(event)
        elif kind in (EventKind.START_REFUSED, EventKind.LAUNCH_FAILED):
            if self.phase in ACTIVE_PHASES:
                self._book("startup" if self.phase is not Phase.TRAINING else "detection", when)
            self._end_attempt(failed=True)
        elif kind is EventKind.FAILURE:
            self._failure(event)
        elif kind is EventKind.STOP_REQUESTED:
            self._stop_asked = True
        elif kind in (EventKind.STOPPED, EventKind.GAVE_UP):
            if self.phase is Phase.TRAINING:
                self._book("unaccounted", when)  # stopped without the trainer's word (killed)
            elif self.phase in (Phase.LAUNCHING, Phase.STARTED):
                self._book("startup", when)
            if self.phase in ACTIVE_PHASES:
                self._end_attempt(failed=kind is EventKind.GAVE_UP)
        elif kind is EventKind.ROLLBACK:
            self.rollbacks += 1
            if self.phase is Phase.TRAINING and self.cursor is not None:
                self._book("lost_work", when)  # the reload of the checkpoint
            to_step = event.fields.get("to_step")
            if isinstance(to_step, int):
                self._cut(to_step)
        elif kind is EventKind.CHECKPOINT:
            step = event.fields.get("step")
            if isinstance(step, int):
                self.checkpoint_steps.append(step)
            seconds = _number(event.fields.get("seconds"))
            if seconds is not None:
                self.checkpoint_writes.append(seconds)

    def _trainer_exit(self, event: Event) -> None:
        code = event.exit_code
        failed = code not in (0, None)
        state = event.fields.get("state")
        if self.phase is Phase.TRAINING:
            self._tail(event.time, event.fields.get("checkpoint_stall"), failed)
        elif self.phase in (Phase.LAUNCHING, Phase.STARTED):
            self._book("startup", event.time)
        if not failed and state == RunState.STOPPED.value and not self._stop_asked:
            self.preemptions += 1  # saved and stopped on a signal nobody here asked for
        self._end_attempt(failed=failed)

    def _tail(self, when: float, stall: Any, failed: bool) -> None:
        """From the last step to the trainer's exit: the final save, a last evaluation, and the
        wait for a dead peer (detection) or the shutdown (unaccounted)."""
        assert self.cursor is not None
        gap = max(0.0, when - self.cursor)
        stall_s = min(_number(stall) or 0.0, gap)
        eval_s = min(self._pending_eval, gap - stall_s)
        self._pending_eval = 0.0
        self.totals["checkpoint_stall"] += stall_s
        self.stall_total += stall_s
        self.totals["evaluation"] += eval_s
        self.cursor += stall_s + eval_s
        self._book("detection" if failed else "unaccounted", when)

    def _failure(self, event: Event) -> None:
        if self.phase is Phase.TRAINING:
            self._book("detection", event.time)
        elif self.phase in (Phase.LAUNCHING, Phase.STARTED):
            self._book("startup", event.time)
        elif self.phase is Phase.ENDED_FAILED:
            self._book("detection", event.time)  # the poll that saw the trainer's exit
        elif self.phase is Phase.ENDED_OK:
            self._book("waiting", event.time)
        if self.phase in ACTIVE_PHASES:
            self._end_attempt(failed=not event.fields.get("preempted"))
            if event.fields.get("preempted"):
                self.preemptions += 1
        self.phase = Phase.WAITING

    def _end_attempt(self, failed: bool) -> None:
        self._settle_first(None)
        if failed and not self._attempt_failed:
            self.failures += 1
        self._attempt_failed = self._attempt_failed or failed
        if self.first_startup is None and self.attempts:
            self.first_startup = self._attempt_startup
        self.phase = Phase.ENDED_FAILED if failed else Phase.ENDED_OK

    def _cut(self, step: int) -> None:
        dropped, seconds = self.lineage.cut_after(step)
        if dropped:
            if self._first is not None and self._first.step > step:
                self._first = None  # a first step that is dropped needs no settling
            self.steps_lost += dropped
            self.totals["lost_work"] += seconds
        self.checkpoint_steps = [s for s in self.checkpoint_steps if s <= step]

    def _train(self, record: dict[str, Any]) -> None:
        when, step = _number(record.get("time")), record.get("step")
        if when is None or not isinstance(step, int):
            return
        step_time = _number(record.get("step_time")) or 0.0
        if self.phase not in (Phase.STARTED, Phase.TRAINING):
            # Steps without a `start` event: an attempt the events do not show.
            self._open_attempt(when - step_time)
            self.phase = Phase.STARTED
        self._cut(step - 1)  # a step done again: what came after its previous run is lost
        assert self.cursor is not None
        gap = max(0.0, when - self.cursor)
        stall = min(_number(record.get("checkpoint_stall")) or 0.0, gap)
        evaluation = min(self._pending_eval, gap - stall)
        self._pending_eval = 0.0
        self.stall_total += stall
        rest = gap - stall - evaluation
        if self.phase is Phase.STARTED:
            # The first step of an attempt: whatever lay between the trainer's start and this
            # step's work is startup; how much of the step itself is too is settled later.
            own = min(step_time, rest)
            self._book("startup", self.cursor + (rest - own))
            parts = {"productive": own, "checkpoint_stall": stall, "evaluation": evaluation}
            self.lineage.append(step, parts)
            self._first = _FirstStep(step, step_time, own)
            self.phase = Phase.TRAINING
        else:
            self._settle_first(step_time)
            excess = max(0.0, rest - step_time) if step_time else 0.0
            parts = {
                "productive": rest - excess,
                "checkpoint_stall": stall,
                "evaluation": evaluation,
                "unaccounted": excess,
            }
            self.lineage.append(step, parts)
            self.step_times.append(step_time)
        self.cursor = max(self.cursor, when)

    def _settle_first(self, ordinary: float | None) -> None:
        """Book the part of the attempt's first step beyond an ordinary step as startup."""
        first, self._first = self._first, None
        if first is None:
            return
        if ordinary is None:
            ordinary = self.median_step_time()
        if ordinary is None:
            self.step_times.append(first.step_time)
            return
        extra = max(0.0, first.booked - ordinary)
        self.lineage.move_last("productive", extra)
        self.totals["startup"] += extra
        self._attempt_startup += extra
        self.step_times.append(min(first.step_time, ordinary))

    def median_step_time(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    # the result ---------------------------------------------------------------------------------
    def result(self, now: float | None = None) -> Goodput:
        """The accounting so far. `now`: the run is active, and the time since its last record
        counts up to `now` (a step in progress, a start, a wait); None: it ended at its last
        record."""
        totals = dict(self.totals)
        for part in STEP_PARTS:
            totals[part] += self.lineage.total(part)
        ordinary = self.median_step_time()
        first = self._first
        if first is not None and ordinary is not None:  # the newest attempt's first step
            extra = max(0.0, first.booked - ordinary)
            totals["productive"] -= extra
            totals["startup"] += extra
        active = now is not None and self.cursor is not None
        end = max(now, self.last_time or 0.0) if active and now is not None else self.last_time
        if end is not None and self.cursor is not None and end > self.cursor:
            # After the newest booking: a step in progress, a start, a wait; for an ended run the
            # events after its last booking (a stop's record, watch giving up).
            open_s = end - self.cursor
            if self.phase is Phase.TRAINING:
                allowance = OPEN_STEP_ALLOWANCE * (ordinary or 0.0) if active else 0.0
                totals["productive"] += min(open_s, allowance)
                totals["unaccounted"] += max(0.0, open_s - allowance)
            elif self.phase in (Phase.LAUNCHING, Phase.STARTED):
                totals["startup"] += open_s
            elif self.phase is Phase.ENDED_FAILED:
                totals["detection"] += open_s
            elif self.phase is Phase.ENDED_OK and not active:
                totals["unaccounted"] += open_s  # the shutdown after the trainer's last word
            else:
                totals["waiting"] += open_s
        wall = (end - self.origin) if end is not None and self.origin is not None else 0.0
        startups = totals["startup"]
        first_startup = self.first_startup if self.first_startup is not None else startups
        restarts = max(0, self.attempts - 1)
        restart_cost = (
            (totals["detection"] + totals["waiting"] + startups - first_startup) / restarts
            if restarts
            else None
        )
        newest = max(self.checkpoint_steps, default=0)
        return Goodput(
            run=self.run,
            wall_s=wall,
            parts=totals,
            start=self.origin,
            end=end,
            active=active,
            attempts=self.attempts,
            failures=self.failures,
            preemptions=self.preemptions,
            rollbacks=self.rollbacks,
            steps_kept=len(self.lineage),
            steps_lost=self.steps_lost,
            step_time_s=ordinary,
            checkpoints=len(self.checkpoint_writes),
            checkpoint_stall_s=(
                self.stall_total / len(self.checkpoint_writes) if self.checkpoint_writes else None
            ),
            checkpoint_write_s=(
                statistics.median(self.checkpoint_writes) if self.checkpoint_writes else None
            ),
            first_startup_s=first_startup,
            restart_cost_s=restart_cost,
            lost_per_failure_s=totals["lost_work"] / self.failures if self.failures else None,
            at_risk_s=self.lineage.seconds_after(newest),
        )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _time_of(item: Event | dict[str, Any]) -> float:
    if isinstance(item, Event):
        return item.time
    return _number(item.get("time")) or 0.0


# At equal times: an attempt's opening events, then metric records, then every other event
# (a record and the exit that follows it can carry the same clock reading).
_OPENING = frozenset({EventKind.LAUNCHED.value, EventKind.START.value})


def order_key(item: Event | dict[str, Any]) -> int:
    if isinstance(item, Event):
        return 0 if item.kind in _OPENING else 2
    return 1


def merged(events: Iterable[Event], records: Iterable[dict[str, Any]]) -> Iterator[Any]:
    """Events and metric records in time order (`order_key` at equal times)."""
    items: list[tuple[float, int, int, Event | dict[str, Any]]]
    items = [(e.time, order_key(e), i, e) for i, e in enumerate(events)]
    items += [
        (_time_of(r), 1, i, r) for i, r in enumerate(records) if r.get("kind") in ("train", "val")
    ]
    items.sort(key=lambda item: item[:3])
    return (item[3] for item in items)


def account(
    run: str, events: list[Event], records: Iterable[dict[str, Any]], now: float | None
) -> Goodput:
    """The accounting of a run's events and metric records; `now` while it is active."""
    fold = GoodputFold(run=run)
    for item in merged(events, records):
        fold.feed(item)
    return fold.result(now)


def goodput(run_dir: RunDir, now: float | None = None) -> Goodput:
    """The accounting of a run directory; an active run counts up to `now` (default: the
    current time), an ended one to its last record."""
    import time

    events = run_dir.events()
    state = fold_state(events)
    active = state is not None and state.active
    when = (now if now is not None else time.time()) if active else None
    return account(run_dir.name, events, read_jsonl(run_dir.metrics_path), when)

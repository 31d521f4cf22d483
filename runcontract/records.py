"""Typed records of the run directory: `Status` (status.json) and `Event` (one line of
events.jsonl), with tolerant readers (a field of the wrong type reads as missing) and the fold of
events into the run's state of record."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from runcontract.states import (
    EVENT_STATES,
    EventKind,
    RunState,
    allowed,
    parse_kind,
    parse_state,
)


def _number(record: Mapping[str, Any], key: str, kind: type[int] | type[float]) -> Any:
    value = record.get(key)
    if value is None or isinstance(value, bool):
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Status:
    """status.json: the trainer's newest progress snapshot (every field optional)."""

    state: RunState | None = None
    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    updated: float | None = None  # unix time of the snapshot
    exit_code: int | None = None  # once the trainer has ended
    step_time: float | None = None  # mean seconds per step since the previous snapshot
    comm_time: float | None = None  # of which this rank's gradient collectives ran (rank 0)
    checkpoint_interval_steps: int | None = None

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Status:
        return cls(
            state=parse_state(record.get("state")),
            step=_number(record, "step", int),
            max_steps=_number(record, "max_steps", int),
            loss=_number(record, "loss", float),
            tokens_per_s=_number(record, "tokens_per_s", float),
            updated=_number(record, "updated", float),
            exit_code=_number(record, "exit_code", int),
            step_time=_number(record, "step_time", float),
            comm_time=_number(record, "comm_time", float),
            checkpoint_interval_steps=_number(record, "checkpoint_interval_steps", int),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON of status.json: fields that are set, states as their names."""
        out: dict[str, Any] = {}
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if value is not None:
                out[item.name] = value.value if isinstance(value, RunState) else value
        return out

    @property
    def stopped_before_end(self) -> bool:
        """The trainer saved and exited 0 on SIGTERM/SIGUSR1 before its last step.

        Exit code 0 alone cannot tell this from a finished run: whoever did not ask for the stop
        (a preemption, a scheduler's time limit) should resume the run from its newest
        checkpoint.
        """
        return (
            self.state is RunState.STOPPED
            and self.step is not None
            and self.max_steps is not None
            and self.step < self.max_steps
        )


def stopped_before_end(status: Mapping[str, Any]) -> bool:
    """`Status.stopped_before_end` of a raw status.json mapping."""
    return Status.from_dict(status).stopped_before_end


@dataclass(frozen=True)
class Event:
    """One line of events.jsonl: when, what (`kind`: an `EventKind` value; a line of a kind this
    version does not know keeps its name) and the kind's fields."""

    time: float
    kind: str
    fields: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Event:
        rest = {k: v for k, v in record.items() if k not in ("time", "event")}
        try:
            when = float(record.get("time", 0.0))
        except (TypeError, ValueError):
            when = 0.0
        return cls(when, str(record.get("event", "")), rest)

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "event": self.kind, **self.fields}

    @property
    def known_kind(self) -> EventKind | None:
        return parse_kind(self.kind)

    @property
    def moves_to(self) -> RunState | None:
        kind = self.known_kind
        if kind is EventKind.EXIT:
            return parse_state(self.fields.get("state"))
        return EVENT_STATES.get(kind) if kind is not None else None

    @property
    def exit_code(self) -> int | None:
        code = self.fields.get("exit_code")
        return code if isinstance(code, int) and not isinstance(code, bool) else None


def fold_state(events: Iterable[Event]) -> RunState | None:
    """The state of record: each event's move applied when `TRANSITIONS` allows it."""
    state: RunState | None = None
    for event in events:
        new = event.moves_to
        if new is not None and new != state and allowed(state, new):
            state = new
    return state

"""Run states, the events that move them and the transitions allowed: the one state machine.

A run's state of record is its events.jsonl folded through `TRANSITIONS` (`records.fold_state`):
append-only lines that the trainer and rlmctl write without racing; a move the table does not
allow (a `stopped` after `done`, a failed resume after `done`) changes nothing. Every state and
event name anywhere in the tree is a member of `RunState` or `EventKind`, never a string literal.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class RunState(str, Enum):
    """Where a run is in its life; `TRANSITIONS` says which moves are allowed."""

    LAUNCHING = "launching"  # rlmctl is starting an attempt; no trainer has said anything yet
    STARTING = "starting"  # a trainer is setting up (data, model, checkpoint); status.json only
    RUNNING = "running"  # a trainer started training (its `start` event)
    STOPPING = "stopping"  # an operator asked for a stop; the trainer saves and exits
    STOPPED = "stopped"  # ended before its last step after saving (stop, preemption): resumable
    DONE = "done"  # reached its last step
    FAILED = "failed"  # ended with an error; the exit code says whether a restart can help

    def __str__(self) -> str:
        return self.value

    @property
    def active(self) -> bool:
        """Processes are expected to be alive in this state."""
        return self in ACTIVE_STATES

    @property
    def ended(self) -> bool:
        return self in END_STATES


class EventKind(str, Enum):
    """Every kind of line in events.jsonl, with who writes it."""

    # rlmctl
    LAUNCHED = "launched"  # an attempt is being started (launch or resume), before any process
    LAUNCH_FAILED = "launch_failed"  # the attempt did not start, or ended before its trainer did
    STOP_REQUESTED = "stop_requested"  # rlmctl stop (or watch stopping a broken job), pre-signal
    STOPPED = "stopped"  # rlmctl verified that no process of the run remains
    STOP_FAILED = "stop_failed"  # processes survived SIGKILL, or a host did not answer
    FAILURE = "failure"  # watch saw the attempt fail (reason, exit code, step, where)
    EXCLUDED = "excluded"  # hosts left out of the next attempt
    READMITTED = "readmitted"  # excluded hosts let back in: in service again, strikes left
    GAVE_UP = "gave_up"  # watch: not restartable, or the restart budget is used up
    # Slurm put the job back in the queue (time limit, preemption, NODE_FAIL, scontrol requeue):
    # the batch script (a requeue it asks for) or watch (one Slurm made), with the reason
    REQUEUED = "requeued"
    CHECKPOINT_INTERVAL = "checkpoint_interval"  # watch chose the interval of later attempts
    # the trainer
    START = "start"  # set up, begins (or continues) training
    START_REFUSED = "start_refused"  # refused to start (config, checkpoint.resume, data, lock)
    EXIT = "exit"  # its last word: exit code and the state it ended in
    CHECKPOINT = "checkpoint"
    CHECKPOINT_FAILED = "checkpoint_failed"
    NONFINITE = "nonfinite"
    ROLLBACK = "rollback"
    COMM_PATH = "comm_path"

    def __str__(self) -> str:
        return self.value


ACTIVE_STATES = frozenset(
    {RunState.LAUNCHING, RunState.STARTING, RunState.RUNNING, RunState.STOPPING}
)
END_STATES = frozenset({RunState.STOPPED, RunState.DONE, RunState.FAILED})
_START = frozenset({RunState.LAUNCHING, RunState.STARTING, RunState.RUNNING})
# None: a run directory without any state event yet. A trainer may start without rlmctl (Slurm,
# by hand), so every start state is reachable from the end states. DONE moves only on to a new
# trainer start (a higher train.steps): nothing an operator or a failed start does undoes it.
TRANSITIONS: dict[RunState | None, frozenset[RunState]] = {
    None: _START,
    RunState.LAUNCHING: (_START | END_STATES | {RunState.STOPPING}) - {RunState.LAUNCHING},
    RunState.STARTING: frozenset({RunState.RUNNING, RunState.STOPPING}) | END_STATES,
    RunState.RUNNING: frozenset({RunState.STOPPING}) | END_STATES,
    RunState.STOPPING: END_STATES | _START,  # a stop that failed, then a resume
    RunState.STOPPED: _START | {RunState.FAILED},  # watch stopped it after a failure, gave up
    RunState.FAILED: _START,
    RunState.DONE: frozenset({RunState.STARTING, RunState.RUNNING}),
}

# The state an event moves the run to (`exit` carries its own in "state"). A refused start moves
# nothing: whatever the run was (done, stopped) it still is; the launcher that started that
# attempt records `launch_failed` when the run would otherwise stay `launching`.
EVENT_STATES: dict[EventKind, RunState] = {
    EventKind.LAUNCHED: RunState.LAUNCHING,
    EventKind.START: RunState.RUNNING,
    EventKind.STOP_REQUESTED: RunState.STOPPING,
    EventKind.STOPPED: RunState.STOPPED,
    EventKind.LAUNCH_FAILED: RunState.FAILED,
    EventKind.GAVE_UP: RunState.FAILED,
}
# The events that end or refuse a trainer's attempt, carrying the trainer's own exit code.
TRAINER_END_EVENTS = frozenset({EventKind.EXIT, EventKind.START_REFUSED})


def allowed(old: RunState | None, new: RunState) -> bool:
    return new in TRANSITIONS[old]


def parse_state(value: Any) -> RunState | None:
    try:
        return RunState(value)
    except ValueError:
        return None


def parse_kind(value: Any) -> EventKind | None:
    try:
        return EventKind(value)
    except ValueError:
        return None

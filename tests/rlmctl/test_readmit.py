"""Which excluded hosts `watch` lets back into a run (`lifecycle.readmit`), read from the run's
own events. The backend's word on a node is a scheduler's (a stand-in with fixed answers here;
tests/slurm/test_slurm_rig.py asks real Slurm's `sinfo`)."""

from __future__ import annotations

from pathlib import Path

from rlmctl import lifecycle
from rlmctl.errors import RlmctlError
from runcontract.rundir import RunDir
from runcontract.states import EventKind


class Scheduler:
    """Has `serving` in service, like `sinfo` showing them idle."""

    def __init__(self, serving: set[str]) -> None:
        self.serving = serving

    def in_service(self, hosts: list[str]) -> dict[str, str]:
        return {h: "Slurm has it idle" for h in hosts if h in self.serving}


def run_with(tmp_path: Path, *events: tuple[EventKind, dict]) -> RunDir:
    run = RunDir(tmp_path / "run").create()
    for kind, fields in events:
        run.append_event(kind, **fields)
    return run


def test_a_node_in_service_with_a_strike_left_comes_back_and_is_recorded(tmp_path: Path) -> None:
    run = run_with(
        tmp_path,
        (EventKind.FAILURE, {"reason": "x", "nodes": ["n1"]}),
        (EventKind.EXCLUDED, {"hosts": ["n1"], "reason": "x"}),
        (EventKind.FAILURE, {"reason": "y", "nodes": ["n2"]}),
        (EventKind.EXCLUDED, {"hosts": ["n2"], "reason": "y"}),
    )
    said: list[str] = []
    policy = lifecycle.WatchPolicy()
    back = lifecycle.readmit(Scheduler({"n1", "n2"}), run, {"n1"}, policy, said.append)
    assert back == {"n1"}
    assert lifecycle.excluded_hosts(run) == {"n2"}
    (event,) = [e for e in run.events() if e.kind == EventKind.READMITTED]
    assert event.fields["hosts"] == ["n1"] and event.fields["strikes"] == {"n1": 1}
    assert said == ["readmitting n1 (n1: Slurm has it idle, strike 1 of 2)"]


def test_strikes_out_stragglers_and_nodes_out_of_service_stay_out(tmp_path: Path) -> None:
    run = run_with(
        tmp_path,
        (EventKind.FAILURE, {"reason": "x", "nodes": ["n1"]}),
        (EventKind.EXCLUDED, {"hosts": ["n1"], "reason": "x"}),
        (EventKind.FAILURE, {"reason": "x", "nodes": ["n1"]}),
        (EventKind.EXCLUDED, {"hosts": ["slow"], "reason": "straggler", "stragglers": [{}]}),
        (EventKind.FAILURE, {"reason": "z", "nodes": ["drained"]}),
        (EventKind.EXCLUDED, {"hosts": ["drained"], "reason": "z"}),
    )
    everyone = Scheduler({"n1", "slow"})
    excluded = lifecycle.excluded_hosts(run)
    assert excluded == {"n1", "slow", "drained"}
    said: list[str] = []
    assert lifecycle.readmit(everyone, run, excluded, lifecycle.WatchPolicy(), said.append) == set()
    # One strike more allowed: n1 (two failures) comes back; the straggler never does.
    three = lifecycle.WatchPolicy(strikes=3)
    assert lifecycle.readmit(everyone, run, excluded, three, said.append) == {"n1"}
    # --strikes 1: the first failure is the last.
    once = run_with(tmp_path / "once", (EventKind.FAILURE, {"reason": "x", "nodes": ["n1"]}))
    assert (
        lifecycle.readmit(everyone, once, {"n1"}, lifecycle.WatchPolicy(strikes=1), said.append)
        == set()
    )
    assert said == ["readmitting n1 (n1: Slurm has it idle, strike 2 of 3)"]


class Unanswering:
    def in_service(self, hosts: list[str]) -> dict[str, str]:
        raise RlmctlError("sinfo failed: Unable to contact slurm controller (connect failure)")


def test_a_scheduler_that_does_not_answer_readmits_nobody_and_watch_says_why(
    tmp_path: Path,
) -> None:
    run = run_with(tmp_path, (EventKind.FAILURE, {"reason": "x", "nodes": ["n1"]}))
    said: list[str] = []
    assert (
        lifecycle.readmit(Unanswering(), run, {"n1"}, lifecycle.WatchPolicy(), said.append) == set()
    )
    assert said == [
        "no host readmitted: sinfo failed: Unable to contact slurm controller (connect failure)"
    ]
    assert not [e for e in run.events() if e.kind == EventKind.READMITTED]

"""Goodput accounting, the checkpoint interval model and straggler flags, on run directories
written by hand for the edge cases (the real trainer's runs are in tests/rlmctl/test_goodput_runs.py).

Every run directory here is written through the contract's own writers (RunDir.append_event,
append_metrics); times are given explicitly so that each part has one exact expected value.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from runcontract.goodput import PARTS, account, goodput
from runcontract.interval import (
    Exposure,
    choose_interval,
    expected_goodput,
    exposure,
    young_daly_seconds,
)
from runcontract.records import Event
from runcontract.rundir import RunDir
from runcontract.stragglers import RankWindows, figures, stragglers


class Timeline:
    """Events and metric records of one run at chosen times."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.records: list[dict] = []

    def event(self, when: float, kind: str, **fields: object) -> Timeline:
        self.events.append(Event(when, kind, dict(fields)))
        return self

    def steps(
        self,
        first: int,
        last: int,
        start: float,
        step_s: float,
        *,
        first_step_s: float | None = None,
        stall: dict[int, float] | None = None,
    ) -> float:
        """Train records for steps first..last, one every `step_s` (plus the stall recorded on
        a step); the first takes `first_step_s`. The time of the last record."""
        when = start
        for step in range(first, last + 1):
            own = first_step_s if (step == first and first_step_s) else step_s
            pause = (stall or {}).get(step, 0.0)
            when += own + pause
            self.records.append(
                {
                    "kind": "train",
                    "step": step,
                    "time": when,
                    "step_time": own,
                    "checkpoint_stall": pause,
                }
            )
        return when

    def val(self, when: float, step: int, seconds: float) -> Timeline:
        self.records.append({"kind": "val", "step": step, "time": when, "seconds": seconds})
        return self

    def account(self, now: float | None = None):
        return account("t", self.events, self.records, now)


def assert_adds_up(result) -> None:
    assert set(result.parts) == set(PARTS)
    assert all(v >= -1e-9 for v in result.parts.values()), result.parts
    assert sum(result.parts.values()) == pytest.approx(result.wall_s, abs=1e-6), result.parts


def test_a_clean_run_is_startup_steps_stalls_evaluation_and_shutdown() -> None:
    t = Timeline()
    t.event(0.0, "launched", hosts=["a", "b"])
    t.event(8.0, "start", step=0)
    # 10 steps of 1 s, the first 3 s (compiling); the save after step 5 stalls 0.5 s, which the
    # trainer records on step 6's record; evaluation of 2 s after step 5 is in step 6's gap.
    t.steps(1, 5, 8.0, 1.0, first_step_s=3.0)  # ends at 15
    t.val(17.5, 5, 2.0)
    t.records.append(
        {"kind": "train", "step": 6, "time": 18.5, "step_time": 1.0, "checkpoint_stall": 0.5}
    )
    t.steps(7, 10, 18.5, 1.0)  # ends at 22.5
    t.event(22.7, "checkpoint", step=10, seconds=0.2)
    t.event(23.0, "exit", exit_code=0, state="done", step=10, checkpoint_stall=0.3)
    g = t.account()
    assert_adds_up(g)
    assert g.wall_s == pytest.approx(23.0)
    assert g.parts["startup"] == pytest.approx(8.0 + 2.0)  # launch → start, the compile
    assert g.parts["productive"] == pytest.approx(10.0)
    assert g.parts["checkpoint_stall"] == pytest.approx(0.5 + 0.3)
    assert g.parts["evaluation"] == pytest.approx(2.0)
    assert g.parts["unaccounted"] == pytest.approx(0.2)  # the exit after the last save
    assert g.parts["lost_work"] == g.parts["detection"] == g.parts["waiting"] == 0.0
    assert g.ratio == pytest.approx(10.0 / 23.0)
    assert (g.attempts, g.failures, g.steps_kept, g.steps_lost) == (1, 0, 10, 0)
    assert g.step_time_s == pytest.approx(1.0)


def failed_and_restarted() -> Timeline:
    """Attempt 1: steps 1-15 (checkpoints at 5 and 10), killed after step 15; watch sees it 4 s
    later, stops the rest, backs off; attempt 2 resumes from step 10 and finishes step 20."""
    t = Timeline()
    t.event(0.0, "launched", hosts=["a", "b", "c"])
    t.event(5.0, "start", step=0)
    t.steps(1, 15, 5.0, 1.0, stall={6: 0.5, 11: 0.5})  # ends at 21
    t.event(20.0, "checkpoint", step=5, seconds=0.5)
    t.event(20.5, "checkpoint", step=10, seconds=0.5)
    t.event(25.0, "failure", reason="trainer process gone on c", exit_code=137, nodes=["c"])
    t.event(26.0, "stop_requested")
    t.event(27.0, "stopped")
    t.event(27.5, "excluded", hosts=["c"])
    t.event(37.0, "launched", hosts=["a", "b"])
    t.event(43.0, "start", step=10, resumed_from="step-00000010")
    t.steps(11, 20, 43.0, 1.0)  # ends at 53
    t.event(53.5, "exit", exit_code=0, state="done", step=20, checkpoint_stall=0.5)
    return t


def test_a_failure_splits_into_lost_work_detection_waiting_and_a_second_startup() -> None:
    g = failed_and_restarted().account()
    assert_adds_up(g)
    assert g.wall_s == pytest.approx(53.5)
    # Steps 11-15 of attempt 1 (5 × 1 s, plus the stall recorded on step 11) were done again.
    assert g.parts["lost_work"] == pytest.approx(5.5)
    assert g.steps_lost == 5 and g.steps_kept == 20
    assert g.parts["detection"] == pytest.approx(25.0 - 21.0)
    assert g.parts["waiting"] == pytest.approx(37.0 - 25.0)
    assert g.parts["startup"] == pytest.approx(5.0 + 6.0)
    assert g.parts["productive"] == pytest.approx(20.0)
    assert g.parts["checkpoint_stall"] == pytest.approx(0.5 + 0.5)  # step 6's, and the last save
    assert (g.attempts, g.failures, g.preemptions) == (2, 1, 0)
    assert g.restart_cost_s == pytest.approx(4.0 + 12.0 + 6.0)
    assert g.lost_per_failure_s == pytest.approx(5.5)


def test_a_crash_the_trainer_saw_is_detection_until_its_exit_and_watch_sees_it() -> None:
    t = Timeline()
    t.event(0.0, "launched", hosts=["a"])
    t.event(1.0, "start", step=0)
    t.steps(1, 4, 1.0, 1.0)  # ends at 5
    t.event(35.0, "exit", exit_code=1, state="failed", step=4)  # a peer died: the timeout
    t.event(37.0, "failure", reason="all trainer processes exited", exit_code=1)
    g = t.account()
    assert_adds_up(g)
    assert g.parts["detection"] == pytest.approx(32.0)
    assert g.failures == 1


def test_a_rollback_loses_the_steps_after_its_checkpoint_and_the_reload() -> None:
    t = Timeline()
    t.event(0.0, "launched", hosts=["a"])
    t.event(1.0, "start", step=0)
    t.steps(1, 8, 1.0, 1.0)  # ends at 9; steps 6-8 non-finite
    t.event(9.0, "checkpoint", step=5, seconds=0.1)
    t.event(11.0, "rollback", from_step=8, to_step=5)
    t.steps(6, 10, 11.0, 1.0)  # ends at 16
    t.event(16.0, "exit", exit_code=0, state="done", step=10)
    g = t.account()
    assert_adds_up(g)
    assert g.parts["lost_work"] == pytest.approx(3.0 + 2.0)  # steps 6-8 and the reload
    assert g.steps_lost == 3 and g.rollbacks == 1 and g.failures == 0


def test_a_preemption_is_an_interruption_without_a_failure() -> None:
    t = Timeline()
    t.event(0.0, "launched", hosts=["a"])
    t.event(1.0, "start", step=0)
    t.steps(1, 5, 1.0, 1.0)
    t.event(6.5, "exit", exit_code=0, state="stopped", step=5, checkpoint_stall=0.5)
    t.event(8.0, "failure", reason="trainer stopped on a signal (preempted)", preempted=True)
    t.event(20.0, "launched", hosts=["a"])
    t.event(21.0, "start", step=5)
    t.steps(6, 7, 21.0, 1.0)
    t.event(23.0, "exit", exit_code=0, state="done", step=7)
    g = t.account()
    assert_adds_up(g)
    assert (g.failures, g.preemptions, g.steps_lost) == (0, 1, 0)
    assert g.parts["waiting"] == pytest.approx(20.0 - 6.5)
    assert exposure(t.events).failures == 0


def test_an_active_run_counts_to_now_and_a_silent_one_goes_unaccounted() -> None:
    t = Timeline()
    t.event(0.0, "launched", hosts=["a"])
    t.event(2.0, "start", step=0)
    t.steps(1, 5, 2.0, 1.0)  # ends at 7
    running = t.account(now=8.0)
    assert_adds_up(running)
    assert running.active and running.wall_s == pytest.approx(8.0)
    assert running.parts["unaccounted"] == 0.0  # within two ordinary steps: a step in progress
    hung = t.account(now=107.0)
    assert_adds_up(hung)
    assert hung.parts["unaccounted"] == pytest.approx(100.0 - 2.0)
    starting = Timeline().event(0.0, "launched", hosts=["a"]).account(now=30.0)
    assert_adds_up(starting)
    assert starting.parts["startup"] == pytest.approx(30.0)


def test_a_run_that_never_started_is_all_startup_and_a_refusal_is_a_failed_attempt() -> None:
    t = Timeline()
    t.event(0.0, "launched", hosts=["a"])
    t.event(4.0, "start_refused", exit_code=3, reason="data")
    t.event(4.5, "launch_failed", exit_code=3)
    g = t.account()
    assert_adds_up(g)
    assert g.parts["startup"] == pytest.approx(4.0)
    assert g.ratio == 0.0


def test_steps_without_any_event_and_records_out_of_order_still_add_up(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r").create()
    for step, when in ((1, 10.0), (2, 11.0), (4, 13.5), (3, 12.0)):  # a torn order
        run.append_metrics({"kind": "train", "step": step, "time": when, "step_time": 1.0})
    g = goodput(run)
    assert_adds_up(g)
    assert g.steps_kept == 4 and g.wall_s == pytest.approx(4.5)
    empty = goodput(RunDir(tmp_path / "none").create())
    assert empty.wall_s == 0.0 and empty.ratio is None


@pytest.mark.parametrize("seed", range(40))
def test_random_histories_always_add_up_to_the_wall_time(seed: int) -> None:
    rng = random.Random(seed)
    t = Timeline()
    now, step = 0.0, 0
    kinds = ["launched", "start", "exit", "failure", "stopped", "rollback", "checkpoint", "x"]
    for _ in range(rng.randint(1, 60)):
        now += rng.expovariate(1.0) * rng.choice((0.1, 1.0, 10.0))
        if rng.random() < 0.6:
            step = max(1, step + rng.choice((1, 1, 1, 1, -3)))
            t.records.append(
                {
                    "kind": "train",
                    "step": step,
                    "time": now + rng.uniform(-0.5, 0.5),  # writers' clocks disagree a little
                    "step_time": rng.uniform(0, 2),
                    "checkpoint_stall": rng.choice((0.0, 0.0, rng.uniform(0, 3))),
                }
            )
        elif rng.random() < 0.2:
            t.val(now, step, rng.uniform(0, 5))
        else:
            kind = rng.choice(kinds)
            fields = {"step": rng.randint(0, step), "to_step": rng.randint(0, step)}
            fields["exit_code"] = rng.choice((0, 1, 2, None))
            fields["state"] = rng.choice(("done", "stopped", "failed"))
            t.event(now, kind, **fields)
    g = t.account(now=now + rng.uniform(0, 5) if rng.random() < 0.5 else None)
    assert_adds_up(g)


# the checkpoint interval -----------------------------------------------------------------------
def test_young_daly_and_the_first_order_goodput_model() -> None:
    assert young_daly_seconds(10.0, 18000.0) == pytest.approx(600.0)
    at_optimum = expected_goodput(600.0, 10.0, 18000.0)
    assert at_optimum == pytest.approx(1 - math.sqrt(2 * 10 / 18000))
    assert at_optimum > expected_goodput(150.0, 10.0, 18000.0)
    assert at_optimum > expected_goodput(2400.0, 10.0, 18000.0)


def test_the_chosen_interval_is_bounded_by_the_limit_and_an_async_write() -> None:
    plain = choose_interval(step_time_s=2.0, stall_s=10.0, job_mtbf_s=18000.0)
    assert plain.steps == 300 and plain.bound is None
    capped = choose_interval(step_time_s=0.1, stall_s=10.0, job_mtbf_s=18000.0, max_steps=1000)
    assert capped.steps == 1000 and capped.bound == "max" and capped.optimum_steps == 6000
    floor = choose_interval(
        step_time_s=1.0, stall_s=0.01, job_mtbf_s=1800.0, write_s=30.0, async_save=True
    )
    assert floor.optimum_steps == pytest.approx(6.0) and floor.steps == 30
    assert floor.bound == "async write"
    unknown = choose_interval(step_time_s=1.0, stall_s=1.0, job_mtbf_s=None)
    assert unknown.steps is None and "failure rate" in unknown.reason


def test_exposure_counts_node_failures_not_input_errors_stops_or_preemptions() -> None:
    t = failed_and_restarted()
    seen = exposure(t.events)
    assert seen.failures == 1
    # attempt 1: 3 nodes from 0 to the failure at 25; attempt 2: 2 nodes from 37 to 53.5
    assert seen.node_seconds == pytest.approx(3 * 25.0 + 2 * 16.5)
    assert seen.node_mtbf_s == pytest.approx(seen.node_seconds)
    config_error = Timeline().event(0.0, "launched", hosts=["a"]).event(1.0, "exit", exit_code=2)
    assert exposure(config_error.events).failures == 0
    crashed = Timeline().event(0.0, "launched", nodes=4).event(10.0, "launched", nodes=4)
    assert exposure(crashed.events, now=15.0) == Exposure(1, 4 * 10.0 + 4 * 5.0)


# stragglers ------------------------------------------------------------------------------------
def windows(own: list[list[float]], comm_base: float = 0.5) -> RankWindows:
    ranks = RankWindows(hosts=[f"node{i + 1}" for i in range(len(own[0]))], started=0.0)
    for index, row in enumerate(own):
        step = max(row) + comm_base  # every rank's step is the slowest one's
        ranks.add(10 * (index + 1), 10, [[step, 0.01, step - o] for o in row])
    return ranks


def test_a_rank_slower_than_its_peers_in_every_window_is_a_straggler(tmp_path: Path) -> None:
    ranks = windows([[1.0, 1.0, 1.5, 1.02]] * 3)
    (found,) = stragglers(ranks, margin=0.2, windows=3)
    assert (found.rank, found.host) == (2, "node3")
    assert found.ratio == pytest.approx(1.5 / 1.0)
    assert "rank 2 on node3 is 1.50x slower" in found.describe()
    newest = figures(ranks)
    assert newest[0].comm_s == pytest.approx(1.0) and newest[2].comm_s == pytest.approx(0.5)
    run = RunDir(tmp_path / "r").create()
    ranks.write(run)
    again = RankWindows.read(run)
    assert again is not None and stragglers(again)[0].host == "node3"
    assert json.loads((run.path / "ranks.json").read_text())["format"] == 1


def test_one_slow_window_or_a_small_margin_is_not_a_straggler() -> None:
    blip = windows([[1.0, 1.0, 1.0], [1.0, 1.0, 1.6], [1.0, 1.0, 1.0]])
    assert stragglers(blip, margin=0.2, windows=3) == []
    slight = windows([[1.0, 1.0, 1.15]] * 3)
    assert stragglers(slight, margin=0.2, windows=3) == []
    assert stragglers(windows([[1.0, 1.0, 1.6]] * 2), windows=3) == []  # too few windows
    assert stragglers(windows([[1.0]] * 3)) == []  # one rank has no peers

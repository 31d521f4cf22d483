"""Gradient communication time per step: measured by the DDP hook and FSDP's reduce-scatter on 2
gloo ranks, written to the run directory, exported by rlm-exporter."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.trainer.faults import faults_env
from tests.trainer.training_runs import REPO, TINY, overrides, tiny_config, torchrun
from trainer.commtime import CommTimer, union_seconds
from trainer.rundir import ExitCode, RunDir
from trainer.train import train

SLOW_S = 1.0  # well above what scheduling on a loaded 2-core machine can shift


@pytest.mark.parametrize(
    ("intervals", "covered"),
    [
        ([], 0.0),
        ([(0.0, 1.0), (2.0, 3.0)], 2.0),
        ([(0.0, 2.0), (1.0, 3.0)], 3.0),  # a bucket queued behind another: not 4
        ([(1.0, 3.0), (0.0, 4.0), (5.0, 5.5)], 4.5),
    ],
)
def test_union_counts_overlapping_buckets_once(intervals, covered) -> None:
    assert union_seconds(intervals) == pytest.approx(covered)


def test_host_clock_timer_takes_and_resets() -> None:
    timer = CommTimer()
    first, second = timer.start(), timer.start()
    timer.end(second)
    timer.end(first)
    taken = timer.take()
    assert taken > 0
    assert timer.take() == 0.0


def test_a_collective_that_ends_after_its_step_was_taken_counts_only_in_the_next_window() -> None:
    timer = CommTimer()
    late = timer.start()  # an async all-gather whose future completes after the step's take
    before = time.perf_counter()
    assert timer.take() == 0.0
    timer.end(late)
    after = time.perf_counter()
    assert timer.take() <= after - before


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in RunDir(run_dir).read_metrics() if r["kind"] == "train"]


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_slow_peer_shows_as_communication_time_and_is_exported(
    prepared_data: Path, tmp_path: Path, strategy: str
) -> None:
    # Rank 1 sleeps before each step: rank 0 waits for it in the gradient collective, so rank 0's
    # communication time holds the sleep, and is never more than its step.
    run_dir = tmp_path / "run"
    extra = ("train.steps=3", f"parallel.strategy={strategy}", "metrics.log_every=3")
    env = faults_env(slow_rank=1, slow_s=SLOW_S)
    result = torchrun(2, "--config", str(TINY), *overrides(prepared_data, run_dir, *extra), env=env)
    assert result.returncode == 0, result.stderr[-3000:]

    records = train_records(run_dir)
    assert len(records) == 3
    for record in records:
        assert SLOW_S * 0.6 <= record["comm_time"] <= record["step_time"], record
    status = RunDir(run_dir).read_status()
    mean = sum(r["comm_time"] for r in records) / 3
    assert status["comm_time"] == pytest.approx(mean)
    assert status["step_time"] == pytest.approx(sum(r["step_time"] for r in records) / 3)

    exporter = [sys.executable, "-m", "monitoring.exporter", "--once", "--gpu-source", "none"]
    once = subprocess.run(
        [*exporter, "--run-dir", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    exported = {
        sample.name: sample.value
        for family in text_string_to_metric_families(once)
        for sample in family.samples
        if sample.labels.get("run") == "run"
    }
    assert exported["rlm_run_comm_duration_seconds"] == pytest.approx(status["comm_time"])
    assert exported["rlm_run_step_duration_seconds"] == pytest.approx(status["step_time"])


@pytest.mark.integration
def test_one_rank_has_no_communication_time(prepared_data: Path, tmp_path: Path) -> None:
    assert train(tiny_config(prepared_data, tmp_path / "one", "train.steps=2")) == ExitCode.OK
    assert {r["comm_time"] for r in train_records(tmp_path / "one")} == {0.0}

"""The training loop in-process on the tiny model: learning, the run directory, resume, failure
modes; and as a subprocess: the Prometheus endpoint and a clean stop on SIGTERM."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import torch

from tests.ports import free_port
from tests.trainer.training_runs import (
    REPO,
    final_weights,
    overrides,
    start_training,
    tiny_config,
)
from trainer.config import load_config
from trainer.rundir import ExitCode, RunDir
from trainer.train import train

TRAIN_FIELDS = {
    "kind", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time",
    "data_time", "recurrence", "backprop_depth", "comm_bytes", "comm_wire_bytes", "comm_time",
    "tflops", "mfu", "peak_memory_bytes", "loss_scale", "checkpoint_stall", "time",
}  # fmt: skip


def test_loss_falls_and_the_run_directory_is_complete(prepared_data: Path, tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    cfg = tiny_config(
        prepared_data,
        run.path,
        "train.steps=10",
        "optim.lr=1e-2",
        "optim.warmup_steps=2",
        "checkpoint.interval_steps=5",
        "eval.every=5",
        "eval.depths=1,2",
    )
    assert train(cfg) == ExitCode.OK

    records = run.read_metrics()
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, 11))
    for record in steps:
        assert set(record) == TRAIN_FIELDS
        assert record["tokens"] == record["step"] * 8 * 64
        assert 1 <= record["backprop_depth"] <= record["recurrence"]
        assert record["comm_bytes"] == 0  # one process: nothing to all-reduce
        assert record["tflops"] > 0 and record["mfu"] > 0 and record["peak_memory_bytes"] > 0
    first, last = steps[0]["loss"], [r["loss"] for r in steps[-3:]]
    assert max(last) < first - 0.8, [r["loss"] for r in steps]

    # The sync save after step 5 blocked the loop before step 6 (runcontract.goodput's stall).
    assert steps[5]["checkpoint_stall"] > 0.01 > max(r["checkpoint_stall"] for r in steps[:5])
    validations = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in validations] == [5, 10]
    assert all(r["seconds"] > 0 for r in validations)
    assert set(validations[-1]["perplexity"]) == {"1", "2"}
    assert validations[-1]["perplexity"]["1"] < validations[0]["perplexity"]["1"]

    status = run.read_status()
    assert status["state"] == "done" and status["exit_code"] == 0 and status["step"] == 10
    assert status["max_steps"] == 10 and status["checkpoint_interval_steps"] == 5
    events = [e["event"] for e in run.read_events()]
    assert events[0] == "start" and events[-1] == "exit"
    assert events.count("checkpoint") == 2
    assert [c.step for c in run.checkpoints() if c.valid] == [5, 10]
    assert load_config(run.config_path) == cfg


def test_resume_continues_exactly_where_the_checkpoint_left_off(
    prepared_data: Path, tmp_path: Path
) -> None:
    run = RunDir(tmp_path / "run")
    extra = ("train.steps=4", "checkpoint.interval_steps=2", "checkpoint.keep_last=0")
    assert train(tiny_config(prepared_data, run.path, *extra)) == ExitCode.OK
    straight = final_weights(run.path)
    # Lose the last checkpoint: the next start resumes at step 2 and must replay steps 3-4
    # (same data, depths, latent noise, optimizer moments and learning rates).
    shutil.move(run.checkpoint_path(4), tmp_path / "step-4-aside")
    assert train(tiny_config(prepared_data, run.path, *extra)) == ExitCode.OK
    start = [e for e in run.read_events() if e["event"] == "start"][-1]
    assert start["step"] == 2 and start["resumed_from"].endswith("step-00000002")
    assert run.restarts() == 1
    resumed = final_weights(run.path)
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_non_finite_steps_are_dropped_then_stop(prepared_data: Path, tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    # An absurd learning rate turns the weights into overflow after one update.
    cfg = tiny_config(
        prepared_data,
        run.path,
        "optim.lr=1e6",
        "optim.warmup_steps=0",
        "train.grad_clip=0",
        "train.max_nonfinite=2",
        "train.steps=8",
    )
    assert train(cfg) == ExitCode.NONFINITE
    assert run.read_status()["exit_code"] == ExitCode.NONFINITE
    assert [e["step"] for e in run.read_events() if e["event"] == "nonfinite"] == [2, 3]
    assert len(run.read_metrics()) == 3


def test_fp16_uses_a_loss_scaler(prepared_data: Path, tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    cfg = tiny_config(prepared_data, run.path, "train.precision=fp16", "train.steps=2")
    assert train(cfg) == ExitCode.OK
    records = run.read_metrics()
    assert all(r["loss_scale"] > 1 for r in records)
    assert all(isinstance(r["loss"], float) for r in records)


ARCHITECTURE_METRICS = re.findall(
    r"`(rlm_train_[a-z_]+)", (REPO / "docs/architecture.md").read_text()
)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def test_metrics_endpoint_then_sigterm_saves_and_exits_zero(
    prepared_data: Path, tmp_path: Path
) -> None:
    run = RunDir(tmp_path / "run")
    port = free_port()
    args = overrides(
        prepared_data,
        run.path,
        "train.steps=10000",
        "checkpoint.interval_steps=10000",  # the only checkpoint is the one SIGTERM asks for
        f"metrics.port={port}",
        "metrics.host=127.0.0.1",
        "eval.every=2",
        "eval.depths=1",
        "eval.batches=1",
    )
    proc = start_training(*args)
    try:
        deadline = time.monotonic() + 120
        body = ""
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                body = scrape(f"http://127.0.0.1:{port}/metrics")
            except OSError:
                body = ""
            if re.search(r'^rlm_train_val_perplexity\{[^}]*depth="1"', body, re.M):
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1]
        for name in ARCHITECTURE_METRICS:
            assert re.search(rf'^{name}\{{.*run="run".*\}} ', body, re.M), name
        health = json.loads(scrape(f"http://127.0.0.1:{port}/healthz"))
        assert health["state"] == "running" and health["step"] >= 2

        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == ExitCode.OK, stderr
    status = run.read_status()
    assert status["state"] == "stopped" and status["exit_code"] == 0
    assert [c.step for c in run.checkpoints() if c.valid] == [status["step"]]
    assert "SIGTERM" in stderr

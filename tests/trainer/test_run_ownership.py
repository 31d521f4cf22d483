"""A run directory belongs to one trainer at a time, its effective config is written once, and
bad input or a failed start never changes what an earlier run left (issue 15's review).

Read-only filesystems are real: the trainer runs in a private mount namespace (`unshare -m`)
where the directory is bind-mounted read-only; root ignores file modes, a mount it cannot.
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runcontract.states import EventKind
from tests.trainer.training_runs import (
    REPO,
    TINY,
    cli_env,
    overrides,
    run_cli,
    start_training,
    torchrun,
)
from trainer.rundir import RunDir, RunState


def one_error_line(result, code: int, *fragments: str) -> str:
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def train(data: Path, run: Path, *extra: str):
    return run_cli("train", "--config", str(TINY), *overrides(data, run, *extra))


def files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_micro_batch_zero_is_one_line(prepared_data: Path, tmp_path: Path) -> None:
    result = train(prepared_data, tmp_path / "run", "train.micro_batch=0")
    one_error_line(result, 2, "train.micro_batch")
    assert not (tmp_path / "run").exists()


def trainer_under(prologue: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m trainer ARGS` in a Python that first runs `prologue` (test instrumentation)."""
    source = prologue + '\nsys.argv[0] = "trainer"\n'
    source += 'runpy.run_module("trainer", run_name="__main__", alter_sys=True)\n'
    return subprocess.run(
        [sys.executable, "-c", source, *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


# Prints at exit whether torch was ever loaded.
TORCH_LOADED_AT_EXIT = """
import atexit, runpy, sys

atexit.register(lambda: print("torch loaded:", "torch" in sys.modules))
"""


def test_a_config_error_answers_before_torch_loads(prepared_data: Path, tmp_path: Path) -> None:
    """A typo in an override is one line in a fraction of a second: the config (torch-free) is
    checked before the trainer loads torch (seconds, more on a busy login node)."""
    args = overrides(prepared_data, tmp_path / "run", "train.micro_batch=0")
    result = trainer_under(TORCH_LOADED_AT_EXIT, "train", "--config", str(TINY), *args)
    one_error_line(result, 2, "train.micro_batch")
    assert result.stdout.strip() == "torch loaded: False", result.stdout


def test_a_misspelt_section_suggests_the_field(prepared_data: Path, tmp_path: Path) -> None:
    result = train(prepared_data, tmp_path / "run", "optimiser.weight_decay=0.1")
    one_error_line(result, 2, "did you mean 'optim.weight_decay'")


@pytest.mark.integration
def test_a_second_trainer_on_a_live_run_is_refused(prepared_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = start_training(*overrides(prepared_data, run, "train.steps=100000"))
    try:
        deadline = time.monotonic() + 120
        while RunDir(run).state() is not RunState.RUNNING:
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            assert time.monotonic() < deadline, "the first trainer never started"
            time.sleep(0.2)  # polling the run directory the first trainer writes
        config = (run / "config.yaml").read_bytes()
        second = train(prepared_data, run, "train.steps=3")
        one_error_line(second, 2, f"PID {first.pid}", socket.gethostname(), "in use")
        assert (run / "config.yaml").read_bytes() == config
        assert [e.kind for e in RunDir(run).events()].count("start") == 1
        assert all(e.fields.get("pid") != second.args for e in RunDir(run).events())
    finally:
        first.terminate()
        first.communicate(timeout=120)
    assert first.returncode == 0


def test_a_stale_lock_of_a_dead_trainer_is_taken_over(prepared_data: Path, tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").create()
    run.lock_path.write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 3}))
    result = train(prepared_data, run.path, "train.steps=2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert run.state() is RunState.DONE


def refusals(run: RunDir) -> list[tuple[str, dict]]:
    """The events a refused start appended: start_refused, then exit (no state)."""
    return [(e.kind, e.fields) for e in run.events() if e.kind in ("start_refused", "exit")]


@pytest.mark.integration
def test_a_failed_resume_leaves_a_finished_run_as_it_was(
    prepared_data: Path, tmp_path: Path
) -> None:
    run = RunDir(tmp_path / "run")
    assert train(prepared_data, run.path, "train.steps=3").returncode == 0
    before = {name: (run.path / name).read_bytes() for name in ("config.yaml", "status.json")}
    wrong_step = train(prepared_data, run.path, "train.steps=3", "checkpoint.resume=step-00000099")
    one_error_line(wrong_step, 2, "checkpoint.resume")
    other_shape = train(prepared_data, run.path, "train.steps=5", "model.d_model=96")
    # names the first tensor that differs, both shapes, and the way out
    line = one_error_line(other_shape, 2, "embedding.weight", "96", "checkpoint.resume=never")
    assert {n: (run.path / n).read_bytes() for n in before} == before
    assert run.state() is RunState.DONE and run.status().step == 3
    # Each refusal: start_refused with the code and the error line, and its exit (no state).
    kinds = [(kind, fields["exit_code"]) for kind, fields in refusals(run)]
    assert kinds == [("exit", 0), *[("start_refused", 2), ("exit", 2)] * 2], kinds
    assert refusals(run)[-2][1]["reason"] == line.removeprefix("error: ")
    assert all(fields.get("state") is None for _, fields in refusals(run)[1:])


def launched_run(run: Path) -> RunDir:
    """A run directory as `rlmctl launch` leaves it before any trainer started."""
    made = RunDir(run).create_exclusive("# config\n", {"inventory": "test", "created": time.time()})
    assert made.record(EventKind.LAUNCHED, hosts=["localhost"])
    return made


def test_a_refused_start_never_moves_a_launching_run(prepared_data: Path, tmp_path: Path) -> None:
    """A bad checkpoint.resume on a run rlmctl just launched rewrote status.json to failed at
    step 0 and moved the run to failed through its exit event; the launcher must decide."""
    run = launched_run(tmp_path / "run")
    result = train(prepared_data, run.path, "train.steps=3", "checkpoint.resume=step-00000099")
    line = one_error_line(result, 2, "checkpoint.resume=step-00000099")
    assert not run.status_path.exists()
    assert run.state() is RunState.LAUNCHING
    (refused, exited) = refusals(run)
    assert refused == ("start_refused", {"exit_code": 2, "reason": line.removeprefix("error: ")})
    assert exited == ("exit", {"exit_code": 2, "state": None, "step": None})


def test_a_data_error_under_torchrun_is_exit_3_from_the_worker_and_one_refusal(
    prepared_data: Path, tmp_path: Path
) -> None:
    """torchrun turns every failed worker into its own exit 1; the worker's code (3: a restart
    cannot help) reaches the launcher through the run directory, once (rank 0 writes it)."""
    run = launched_run(tmp_path / "run")
    missing = tmp_path / "no-such-data"
    args = [*overrides(prepared_data, run.path, "train.steps=3"), f"data.path={missing}"]
    result = torchrun(2, "--config", str(TINY), *args, timeout=180)
    assert result.returncode != 0
    assert "exitcode  : 3 " in result.stderr, result.stderr[-3000:]  # torchrun names the code
    errors = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert errors and all(f"data.path {missing} does not exist" in x for x in errors), errors
    assert not run.status_path.exists() and run.state() is RunState.LAUNCHING
    assert [(k, f["exit_code"]) for k, f in refusals(run)] == [("start_refused", 3), ("exit", 3)]


# A real SIGTERM to itself at the moment the trainer starts to import torch: where a rank is
# when torchrun stops it because a faster rank failed.
SIGTERM_WHILE_TORCH_LOADS = """
import os, runpy, signal, sys

class SigtermOnTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGTERM)
        return None

sys.meta_path.insert(0, SigtermOnTorch())
"""


def test_a_sigterm_while_torch_loads_still_records_the_refusal(
    prepared_data: Path, tmp_path: Path
) -> None:
    """CI: under torchrun, rank 1 hit the missing data first and exited 3; torchrun's SIGTERM
    reached rank 0 while it was still importing torch, before any handler, and nothing was
    recorded. The trainer catches SIGTERM before it loads torch, so the rank that was told to
    stop reaches the same refusal and records it."""
    run = launched_run(tmp_path / "run")
    missing = tmp_path / "no-such-data"
    args = [*overrides(prepared_data, run.path), f"data.path={missing}"]
    result = trainer_under(SIGTERM_WHILE_TORCH_LOADS, "train", "--config", str(TINY), *args)
    assert result.returncode == 3, (result.returncode, result.stderr[-3000:])
    assert "SIGTERM: stopping" in result.stderr, result.stderr[-3000:]
    assert f"error: data.path {missing} does not exist" in result.stderr, result.stderr[-3000:]
    assert [(k, f["exit_code"]) for k, f in refusals(run)] == [("start_refused", 3), ("exit", 3)]


@pytest.mark.integration
def test_no_usable_checkpoint_is_not_a_silent_restart(prepared_data: Path, tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    assert train(prepared_data, run.path, "train.steps=3").returncode == 0
    (newest,) = run.checkpoints()
    weights = [p for p in sorted(newest.path.rglob("*.pt")) if p.stat().st_size]
    victim = weights[0]
    victim.write_bytes(victim.read_bytes()[:-1])  # truncated: no checkpoint verifies
    metrics = run.metrics_path.read_bytes()
    result = train(prepared_data, run.path, "train.steps=6")
    one_error_line(result, 3, "checkpoint.resume=never", newest.path.name)
    assert run.metrics_path.read_bytes() == metrics  # nothing trained from step 0


def in_read_only(directory: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    command = f"mount --bind -o ro {shlex.quote(str(directory))} {shlex.quote(str(directory))}"
    command += " && exec " + " ".join(shlex.quote(a) for a in argv)
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", command],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture
def trainer_argv(prepared_data: Path):
    def argv(run: Path, *extra: str) -> list[str]:
        args = overrides(prepared_data, run, *extra)
        return [sys.executable, "-m", "trainer", "train", "--config", str(TINY), *args]

    return argv


def test_a_read_only_run_dir_is_one_line_not_restartable(tmp_path: Path, trainer_argv) -> None:
    run = tmp_path / "run"
    run.mkdir()
    result = in_read_only(run, trainer_argv(run, "train.steps=2"))
    one_error_line(result, 2, "read-only", str(run))
    assert list(run.iterdir()) == []


def test_a_failed_final_save_is_not_done(tmp_path: Path, trainer_argv) -> None:
    run = RunDir(tmp_path / "run").create()
    argv = trainer_argv(run.path, "train.steps=2", "checkpoint.interval_steps=100")
    result = in_read_only(run.checkpoints_dir, [*argv, "checkpoint.on_error=continue"])
    assert result.returncode == 1, result.stderr[-2000:]  # restartable: the steps are redone
    assert run.state() is RunState.FAILED
    assert run.status().exit_code == 1

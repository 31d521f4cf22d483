"""The run-directory contract shared by the trainer, rlmctl and the exporter."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runcontract.exitcodes import ExitCode, attempt_exit_code, restartable
from runcontract.records import Event, stopped_before_end
from runcontract.rundir import (
    RunDir,
    append_jsonl,
    checkpoint_dir_name,
    read_json,
    read_jsonl,
    verify_checkpoint,
    write_json_atomic,
    write_manifest,
)
from runcontract.states import EventKind, RunState


def make_checkpoint(run: RunDir, step: int, payload: bytes = b"weights") -> Path:
    path = run.checkpoint_path(step)
    path.mkdir(parents=True)
    (path / "model.pt").write_bytes(payload)
    (path / "sub").mkdir()
    (path / "sub" / "rng.pt").write_bytes(b"rng")
    write_manifest(path, step, meta={"tokens": 10})
    return path


def test_rundir_module_does_not_import_torch() -> None:
    code = (
        "import sys, trainer.rundir, trainer.errors, trainer.config; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_status_round_trip_and_atomic_replace(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").create()
    assert run.read_status() == {}
    run.write_status(state="running", step=3, loss=2.5)
    run.write_status(state="running", step=4, loss=2.4)
    status = run.read_status()
    assert status["step"] == 4 and status["state"] == "running" and "updated" in status
    assert [p.name for p in run.path.iterdir() if p.name.startswith(".")] == []


def test_jsonl_ignores_torn_last_line(tmp_path: Path) -> None:
    run = RunDir(tmp_path).create()
    run.append_metrics({"step": 1, "loss": 3.0})
    run.append_metrics({"step": 2, "loss": 2.0})
    with open(run.metrics_path, "a") as f:
        f.write('{"step": 3, "lo')
    assert [m["step"] for m in run.read_metrics()] == [1, 2]
    assert list(read_jsonl(tmp_path / "missing.jsonl")) == []


def test_restarts_count_start_events(tmp_path: Path) -> None:
    run = RunDir(tmp_path).create()
    assert run.restarts() == 0
    for _ in range(3):
        run.append_event("start", world_size=2)
    run.append_event("exit", code=0)
    assert run.restarts() == 2


def test_checkpoint_verification(tmp_path: Path) -> None:
    run = RunDir(tmp_path).create()
    make_checkpoint(run, 100)
    newest = make_checkpoint(run, 200, payload=b"newer weights")
    assert [c.step for c in run.checkpoints()] == [100, 200]
    assert run.latest_valid_checkpoint().step == 200

    # A flipped byte keeps the size: only the full check sees it.
    data = bytearray((newest / "model.pt").read_bytes())
    data[0] ^= 0xFF
    (newest / "model.pt").write_bytes(bytes(data))
    assert verify_checkpoint(newest).valid
    full = verify_checkpoint(newest, full=True)
    assert not full.valid and "sha256" in full.reason
    assert run.latest_valid_checkpoint(full=True).step == 100

    (newest / "model.pt").write_bytes(b"short")
    truncated = verify_checkpoint(newest)
    assert not truncated.valid and "model.pt" in truncated.reason
    assert run.latest_valid_checkpoint().step == 100


def test_checkpoint_without_manifest_is_partial(tmp_path: Path) -> None:
    run = RunDir(tmp_path).create()
    partial = run.checkpoint_path(300)
    partial.mkdir(parents=True)
    (partial / "model.pt").write_bytes(b"half")
    info = verify_checkpoint(partial)
    assert not info.valid and "manifest" in info.reason
    assert run.latest_valid_checkpoint() is None
    assert checkpoint_dir_name(300) == partial.name


def test_manifest_step_must_match_directory(tmp_path: Path) -> None:
    run = RunDir(tmp_path).create()
    path = make_checkpoint(run, 5)
    manifest = read_json(path / "manifest.json")
    manifest["step"] = 6
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert not verify_checkpoint(path).valid


def test_exit_codes_tell_what_can_be_restarted() -> None:
    assert ExitCode.FAILED.restartable
    assert not ExitCode.BAD_CONFIG.restartable and not ExitCode.OK.restartable


def test_a_stop_before_the_last_step_is_resumable() -> None:
    assert stopped_before_end({"state": "stopped", "step": 40, "max_steps": 100})
    assert not stopped_before_end({"state": "stopped", "step": 100, "max_steps": 100})
    assert not stopped_before_end({"state": "done", "step": 100, "max_steps": 100})
    assert not stopped_before_end({"state": "stopped", "step": 40})
    assert not stopped_before_end({})


def test_the_one_ranking_of_an_attempts_exit_codes() -> None:
    # Nothing ended yet; launchers only; the first failing launcher.
    assert attempt_exit_code([], []) is None
    assert attempt_exit_code([], [0, 0]) == 0
    assert attempt_exit_code([], [0, 137, 1]) == 137
    # The trainer's own code beats torchrun's 1 (a data error; a clean SIGTERM stop) ...
    assert attempt_exit_code([3], [1, 1]) == 3
    assert attempt_exit_code([0], [1]) == 0
    assert attempt_exit_code([0, 2], [1]) == 2  # the newest word of the attempt
    # ... but a launcher killed by a signal beats a rank 0 that stopped cleanly after it.
    assert attempt_exit_code([0], [1, 137]) == 137
    assert restartable(None) and restartable(1) and restartable(137)
    assert not restartable(0) and not restartable(2) and not restartable(3)


def test_the_exit_code_of_a_run_directorys_newest_attempt(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r").create()
    run.append_event(EventKind.EXIT, exit_code=3, state="failed")  # an earlier attempt's
    run.append_event(EventKind.LAUNCHED, launch="resume")
    assert run.attempt_exit_code() is None
    run.host_dir("n1").mkdir(parents=True)
    write_json_atomic(run.exit_record_path("n1"), {"exit_code": 1, "time": time.time()})
    assert run.attempt_exit_code() == 1
    run.append_event(EventKind.START_REFUSED, exit_code=2, reason="bad checkpoint.resume")
    assert run.attempt_exit_code() == 2 and run.attempt_exit_codes() == [2]


def test_a_host_that_ends_before_rank_0_says_start_ends_this_attempt(tmp_path: Path) -> None:
    """Seen in a full run: one host ended (its exit record written) while rank 0 was still
    starting, and rank 0's `start` came more than a second later. The record then counted as an
    earlier attempt's and watch read the attempt's exit code as None: a data error (3) on a
    host without rank 0 would have been restarted instead of given up on."""
    run = RunDir(tmp_path / "r").create()
    now = time.time()

    def event_at(when: float, kind: EventKind, **fields: object) -> None:
        append_jsonl(run.events_path, Event(now + when, kind.value, dict(fields)).to_dict())

    event_at(-100, EventKind.START, step=0)  # an earlier attempt, started by hand
    event_at(-90, EventKind.EXIT, exit_code=0, state="stopped", step=5)
    event_at(-10, EventKind.LAUNCHED, launch="resume")
    run.host_dir("n2").mkdir(parents=True)
    write_json_atomic(run.exit_record_path("n2"), {"exit_code": 3, "time": now - 8})
    event_at(-5, EventKind.START, step=5)  # rank 0, on n1, after its imports
    assert run.attempt_since() == now - 10
    assert run.attempt_exit_code() == 3
    # A second `start` without a launch is a new attempt (torchrun's own restart, or by hand).
    event_at(-4, EventKind.EXIT, exit_code=0, state="stopped", step=6)
    event_at(-2, EventKind.START, step=6)
    assert run.attempt_since() == now - 2 and run.attempt_exit_code() is None


def test_end_attempt_takes_the_trainers_code_and_never_leaves_the_run_launching(
    tmp_path: Path,
) -> None:
    refused = RunDir(tmp_path / "refused").create()
    refused.append_event(EventKind.LAUNCHED, launch="launch")
    refused.append_event(EventKind.START_REFUSED, exit_code=3, reason="data missing")
    assert refused.state() is RunState.LAUNCHING  # a refused start moves nothing itself
    assert refused.end_attempt("n1", 1) == 3
    record = read_json(refused.exit_record_path("n1"))
    assert record["exit_code"] == 3 and record["launcher_exit_code"] == 1
    assert refused.state() is RunState.FAILED
    # A clean stop: the trainer said 0 (stopped), torchrun 1 on its SIGTERM.
    stopped = RunDir(tmp_path / "stopped").create()
    stopped.append_event(EventKind.LAUNCHED, launch="launch")
    stopped.append_event(EventKind.START, step=0)
    stopped.append_event(EventKind.EXIT, exit_code=0, state="stopped", step=7)
    assert stopped.end_attempt("n1", 1) == 0 and stopped.state() is RunState.STOPPED
    # A resume of a done run that fails never undoes `done`.
    done = RunDir(tmp_path / "done").create()
    done.append_event(EventKind.START, step=0)
    done.append_event(EventKind.EXIT, exit_code=0, state="done", step=20)
    done.append_event(EventKind.START_REFUSED, exit_code=2, reason="bad config")
    assert done.end_attempt("n1", 1) == 2 and done.state() is RunState.DONE


def test_typed_writers_refuse_what_the_contract_does_not_know(tmp_path: Path) -> None:
    run = RunDir(tmp_path).create()
    with pytest.raises(ValueError):
        run.write_status(state="sleeping", step=1)
    with pytest.raises(TypeError):
        run.write_status(state=RunState.RUNNING, stepp=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        run.append_event("launch")  # type: ignore[arg-type]
    written = run.write_status(state=RunState.RUNNING, step=3, loss=2.5)
    assert run.status() == written and run.read_status()["state"] == "running"

"""The run-directory contract shared by the trainer, rlmctl and the exporter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trainer.rundir import (
    ExitCode,
    RunDir,
    checkpoint_dir_name,
    read_json,
    read_jsonl,
    stopped_before_end,
    verify_checkpoint,
    write_manifest,
)


def make_checkpoint(run: RunDir, step: int, payload: bytes = b"weights") -> Path:
    path = run.checkpoint_path(step)
    path.mkdir(parents=True)
    (path / "model.pt").write_bytes(payload)
    (path / "sub").mkdir()
    (path / "sub" / "rng.pt").write_bytes(b"rng")
    write_manifest(path, step, meta={"tokens": 10})
    return path


def test_rundir_module_does_not_import_torch() -> None:
    code = "import sys, trainer.rundir, trainer.errors; print('torch' in sys.modules)"
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

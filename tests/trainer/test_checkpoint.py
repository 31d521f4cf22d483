"""CheckpointStore: atomic saves under SIGKILL, corruption, ENOSPC, retention, async, resume."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.training_runs import REPO
from trainer.checkpoint import (
    MODEL_FILE,
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    CheckpointStore,
)
from trainer.errors import ConfigError, DataError
from trainer.model import PRESETS, RecurrentLM
from trainer.rundir import MANIFEST_NAME, RunDir, read_json, verify_checkpoint

LOGGER = "trainer.checkpoint"


def trained_state(step: int) -> dict[str, Any]:
    """A real tiny RecurrentLM after `step` AdamW steps, in the layout the training loop saves."""
    return copy.deepcopy(_trained_state(step))


@functools.cache
def _trained_state(step: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = RecurrentLM(PRESETS["tiny"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16))
    for _ in range(step):
        model(ids, labels=ids, num_steps=2).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": {"last_epoch": step},
        "scaler": None,
        "progress": {"step": step, "tokens": 32 * step, "sample_index": 2 * step, "epoch": 0},
        "rng": [{"torch": torch.get_rng_state()}],
        "config": {"model": {"preset": "tiny"}},
        "version": "test",
    }


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def manager(path: Path, rank: int = 0, **cfg: Any) -> CheckpointStore:
    return CheckpointStore(RunDir(path).create(), CheckpointConfig(**cfg), rank, 1)


def step_dirs(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "checkpoints").iterdir() if p.name.startswith("step-"))


def hidden_dirs(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "checkpoints").iterdir() if p.name.startswith("."))


# configuration ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("interval_steps", 0, "checkpoint.interval_steps must be >= 1"),
        ("keep_last", -1, "checkpoint.keep_last must be >= 0"),
        ("keep_every", "3", "checkpoint.keep_every must be an integer"),
        ("verify", "sha", "checkpoint.verify must be size or full"),
        ("on_error", "ignore", "checkpoint.on_error must be continue or stop"),
        ("resume", " ", "checkpoint.resume must be auto, never or a checkpoint directory"),
    ],
)
def test_bad_config_is_one_line_config_error(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        CheckpointConfig(**{field: value})
    assert "\n" not in str(info.value)


# save and load -----------------------------------------------------------------------------------
def test_save_writes_complete_directory_and_load_restores_it(tmp_path: Path) -> None:
    state = trained_state(2)
    mgr = manager(tmp_path)
    assert mgr.save(2, state)
    assert (mgr.saves, mgr.failures, mgr.last_saved_step) == (1, 0, 2)
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    manifest = read_json(ckpt / MANIFEST_NAME)
    assert sorted(manifest["files"]) == ["model.pt", "optimizer.pt", "trainer_state.pt"]
    assert manifest["meta"]["progress"]["step"] == 2
    assert verify_checkpoint(ckpt, full=True).valid
    assert hidden_dirs(tmp_path) == []
    assert [e["event"] for e in RunDir(tmp_path).read_events()] == ["checkpoint"]

    loaded = manager(tmp_path).load()
    assert_same(state, loaded)
    assert all(t.device.type == "cpu" for t in loaded["model"].values())


def test_other_ranks_write_nothing_and_never_resumes(tmp_path: Path) -> None:
    assert manager(tmp_path, rank=1).save(1, trained_state(0))
    assert step_dirs(tmp_path) == []
    assert manager(tmp_path).load() is None  # nothing to resume from
    manager(tmp_path).save(1, trained_state(0))
    assert manager(tmp_path, resume="never").load() is None


def test_resume_from_an_explicit_checkpoint(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_last=0)
    mgr.save(1, trained_state(1))
    mgr.save(2, trained_state(2))
    loaded = manager(tmp_path, resume="step-00000001").load()
    assert loaded["progress"]["step"] == 1
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        manager(tmp_path, resume=str(tmp_path / "nope")).load()


def test_saving_an_existing_valid_step_again_keeps_it(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    assert mgr.save(3, trained_state(1))
    before = read_json(tmp_path / "checkpoints" / "step-00000003" / MANIFEST_NAME)
    assert mgr.save(3, trained_state(1))  # e.g. SIGTERM right after an interval save
    assert read_json(tmp_path / "checkpoints" / "step-00000003" / MANIFEST_NAME) == before


# crash safety ----------------------------------------------------------------------------------
CHILD = """
import os, signal, sys, torch
from trainer.checkpoint import CheckpointConfig, CheckpointStore
from trainer.rundir import RunDir

run_dir, stop_at, numel = sys.argv[1], sys.argv[2], int(sys.argv[3])
mgr = CheckpointStore(RunDir(run_dir).create(), CheckpointConfig(keep_last=0), 0, 1)

def state(step):
    return {"model": {"w": torch.full((numel,), float(step))}, "optimizer": {"m": torch.ones(4)},
            "progress": {"step": step}, "rng": [], "config": {}, "version": "t"}

assert mgr.save(1, state(1))

def stop(phase):
    if phase == stop_at:
        os.kill(os.getpid(), signal.SIGSTOP)  # the parent SIGKILLs us here

mgr.phase_hook = stop
mgr.save(2, state(2))
os.kill(os.getpid(), signal.SIGSTOP)
"""


# An async save stuck in its writer thread (a hung filesystem); the main thread waits for it as
# the loop does before the next save. The main thread blocks SIGTERM, so the kernel runs the
# signal's C-level handler in the writer thread: what happens in the trainer when a signal lands
# just before the main thread enters its wait (seen in full suite runs: a stop never announced).
SIGNAL_DURING_A_STUCK_SAVE = """
import signal, sys, threading, torch
from trainer.checkpoint import CheckpointConfig, CheckpointStore
from trainer.rundir import RunDir
from trainer.stop_signals import StopSignals

signals = StopSignals()
signals.install()
store = CheckpointStore(RunDir(sys.argv[1]).create(), CheckpointConfig(async_save=True), 0, 1)
hung = threading.Event()
store.phase_hook = lambda phase: phase == "files-written" and hung.wait()
state = {"model": {"w": torch.ones(4)}, "optimizer": {}, "progress": {"step": 1}, "rng": [],
         "config": {}, "version": "t"}
assert store.save(1, state)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
print("waiting", flush=True)
store.wait()
"""


def test_a_signal_is_handled_while_the_loop_waits_for_a_stuck_save(tmp_path: Path) -> None:
    """Python runs a signal's handler in the main thread between bytecodes; a wait that no signal
    interrupts (a thread join) must still give it the chance, or a stop is not even announced
    while a save hangs, and a second SIGTERM counts as the first."""
    child = subprocess.Popen(
        [sys.executable, "-c", SIGNAL_DURING_A_STUCK_SAVE, str(tmp_path / "run")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "waiting\n"
        child.send_signal(signal.SIGTERM)
        selector = selectors.DefaultSelector()
        selector.register(child.stderr, selectors.EVENT_READ)
        announced = selector.select(timeout=30) and child.stderr.readline()
        assert announced and announced.startswith("SIGTERM: stopping"), announced
    finally:
        child.kill()
        child.communicate()


def wait_stopped(proc: subprocess.Popen[bytes], deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
        if pid and os.WIFSTOPPED(status):
            return
        assert not pid, f"child exited early: {proc.stderr.read().decode()}"
        time.sleep(0.01)
    pytest.fail("child never reached its stop point")


def kill_and_reap(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    os.waitpid(proc.pid, 0)
    proc.returncode = -9  # reaped by hand above; keep Popen from waiting again
    proc.stderr.close()


def poll_file_size(find: Callable[[], list[Path]], minimum: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):  # renamed away between glob and stat
            if any(p.stat().st_size >= minimum for p in find()):
                return
        time.sleep(0.001)
    pytest.fail("the save never started writing")


@pytest.mark.parametrize(
    ("stop_at", "survivor"),
    [
        ("tmp-created", 1),
        (f"written:{MODEL_FILE}", 1),
        ("manifest-written", 1),
        ("renamed", 2),  # renamed but the parent directory not yet fsynced
        ("mid-write", None),  # SIGKILL while model.pt is being written: step 1 or nothing new
    ],
)
def test_sigkill_during_save_leaves_old_or_new_complete_set(
    tmp_path: Path, stop_at: str, survivor: int | None
) -> None:
    numel = 2 << 20  # 8 MiB of float32: long enough to catch the write in progress
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), stop_at, str(numel)],
        stderr=subprocess.PIPE,
    )
    try:
        if stop_at == "mid-write":
            partial = tmp_path / "checkpoints"
            poll_file_size(lambda: list(partial.glob(f".tmp-step-00000002*/{MODEL_FILE}")), 1 << 20)
        else:
            wait_stopped(proc)
    finally:
        kill_and_reap(proc)

    run = RunDir(tmp_path)
    infos = run.checkpoints(full=True)
    assert infos and all(info.valid for info in infos), infos  # step-* dirs only ever complete
    loaded = manager(tmp_path).load()
    expected = survivor if survivor is not None else infos[-1].step
    assert loaded["progress"]["step"] == expected == infos[-1].step
    assert torch.equal(loaded["model"]["w"], torch.full((numel,), float(expected)))

    # The next save of a new process removes the dead process's temp dir, never a step-* dir.
    mgr = manager(tmp_path, keep_last=0)
    assert mgr.save(3, {"model": {}, "optimizer": {}, "progress": {"step": 3}})
    assert hidden_dirs(tmp_path) == []
    assert step_dirs(tmp_path)[-1] == "step-00000003" and len(step_dirs(tmp_path)) == len(infos) + 1


@pytest.mark.parametrize(
    ("damage", "verify", "reason"),
    [
        ("truncate", "size", "has 100 bytes, manifest says"),
        ("flip", "full", "does not match its sha256"),
    ],
)
def test_damaged_newest_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, verify: str, reason: str
) -> None:
    mgr = manager(tmp_path, keep_last=0)
    mgr.save(1, trained_state(1))
    mgr.save(2, trained_state(2))
    target = tmp_path / "checkpoints" / "step-00000002" / MODEL_FILE
    if damage == "truncate":
        os.truncate(target, 100)
    else:
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        loaded = manager(tmp_path, verify=verify).load()
    assert loaded["progress"]["step"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "step-00000002" in warnings[0] and reason in warnings[0]
    assert step_dirs(tmp_path) == ["step-00000001", "step-00000002"]  # nothing deleted


def test_a_manifest_that_cannot_be_read_skips_that_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An OSError other than "missing" reading manifest.json (here EISDIR; EIO in production)
    crashed rank 0 while it listed the candidates, and the other ranks waited for its list."""
    mgr = manager(tmp_path, keep_last=0)
    mgr.save(1, trained_state(1))
    mgr.save(2, trained_state(2))
    manifest = tmp_path / "checkpoints" / "step-00000002" / MANIFEST_NAME
    manifest.unlink()
    manifest.mkdir()  # reading it raises IsADirectoryError, an OSError
    info = verify_checkpoint(manifest.parent)
    assert not info.valid and info.reason.startswith("cannot read manifest.json"), info
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert manager(tmp_path).load()["progress"]["step"] == 1
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "step-00000002" in warning and "cannot read manifest.json" in warning, warning


def test_flipped_byte_is_not_seen_by_size_verification(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Why verify=full exists: a same-size corruption passes the size check.
    mgr = manager(tmp_path)
    mgr.save(1, {"model": {"w": torch.zeros(1000)}, "optimizer": {}, "progress": {"step": 1}})
    target = tmp_path / "checkpoints" / "step-00000001" / MODEL_FILE
    data = bytearray(target.read_bytes())
    data[-3000] ^= 0xFF  # inside the tensor bytes
    target.write_bytes(bytes(data))
    assert manager(tmp_path, verify="size").load()["model"]["w"].abs().sum() > 0
    # Full verification sees it; with no other checkpoint that is a data error, not step 0,
    # and the warning before it says so instead of promising a fresh start.
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        pytest.raises(DataError, match=r"checkpoint\.resume=never"),
    ):
        manager(tmp_path, verify="full").load()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "none left: the resume stops" in warning and "fresh start" not in warning, warning


def test_invalid_checkpoint_at_the_step_being_saved_is_set_aside(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(2, trained_state(2))
    os.remove(tmp_path / "checkpoints" / "step-00000002" / MANIFEST_NAME)
    assert mgr.save(2, trained_state(2))
    assert verify_checkpoint(tmp_path / "checkpoints" / "step-00000002", full=True).valid
    assert [n.split("-step-")[0] for n in hidden_dirs(tmp_path)] == [".invalid"]


# disk full ---------------------------------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs that a second checkpoint cannot fit into."""
    mount = tmp_path / "fs"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("where", ["pre-check", "during-write"])
def test_disk_full_fails_one_save_cleanly_and_training_goes_on(
    small_fs: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    mgr = manager(small_fs / "run")
    first = {"model": {"w": torch.ones(1 << 18)}, "optimizer": {}, "progress": {"step": 1}}
    assert mgr.save(1, first)  # 1 MiB
    if where == "pre-check":  # the tensors alone do not fit: refused before writing anything
        second = {"model": {"w": torch.ones(1 << 20)}, "optimizer": {}, "progress": {"step": 2}}
        expected = "needs about"
    else:  # the estimate fits, the bytes do not (a large non-tensor object): ENOSPC mid-save
        second = {"model": {"w": torch.ones(1 << 16)}, "progress": {"step": 2}}
        second["optimizer"] = {"blob": b"x" * (3 << 20)}
        expected = "No space left on device"

    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert mgr.save(2, second) is False
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "step-00000002 not saved" in errors[0] and expected in errors[0]
    assert (mgr.saves, mgr.failures, mgr.last_saved_step) == (1, 1, 1)
    assert step_dirs(small_fs / "run") == ["step-00000001"]
    assert hidden_dirs(small_fs / "run") == []  # the partial temp dir is gone
    assert manager(small_fs / "run", verify="full").load()["progress"]["step"] == 1
    events = [e["event"] for e in RunDir(small_fs / "run").read_events()]
    assert events == ["checkpoint", "checkpoint_failed"]


def test_on_error_stop_raises_a_checkpoint_error(tmp_path: Path) -> None:
    mgr = manager(tmp_path, on_error="stop", min_free_bytes=1 << 60)
    with pytest.raises(CheckpointError, match="on_error=stop") as info:
        mgr.save(1, trained_state(0))
    assert info.value.exit_code == 1 and mgr.failures == 1
    assert step_dirs(tmp_path) == []


# retention ---------------------------------------------------------------------------------------
def test_retention_keeps_last_k_and_milestones(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_last=2, keep_every=4)
    small = {"model": {"w": torch.zeros(4)}, "optimizer": {}}
    for step in range(1, 10):
        assert mgr.save(step, {**small, "progress": {"step": step}})
    assert step_dirs(tmp_path) == ["step-00000004", "step-00000008", "step-00000009"]
    mgr.wait()  # retention deletes the renamed-away directories in the background
    assert hidden_dirs(tmp_path) == []


def test_retention_never_deletes_invalid_or_the_newest_valid(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_last=1)
    small = {"model": {"w": torch.zeros(4)}, "optimizer": {}}
    mgr.save(1, small)
    mgr.save(2, small)
    os.truncate(tmp_path / "checkpoints" / "step-00000002" / MODEL_FILE, 10)  # invalid now
    mgr.save(3, small)
    mgr.save(4, small)
    assert step_dirs(tmp_path) == ["step-00000002", "step-00000004"]
    assert mgr.retained(RunDir(tmp_path).checkpoints()) == {2, 4}


# async -------------------------------------------------------------------------------------------
def test_async_save_writes_the_state_as_it_was_when_save_returned(tmp_path: Path) -> None:
    state = trained_state(2)
    sync_mgr = manager(tmp_path / "sync")
    async_mgr = manager(tmp_path / "async", async_save=True)
    assert sync_mgr.save(5, state)
    assert async_mgr.save(5, state)
    state["progress"]["step"] = 6  # the loop moves on at once: the rest was copied in save()
    # The tensors are copied to host memory by the background thread; the optimizer step waits
    # for that copy (as the training loop does) and then changes them while the thread writes.
    async_mgr.wait_for_staging()
    for tensor in [*state["model"].values(), state["optimizer"]["state"][0]["exp_avg"]]:
        tensor.add_(1.0)
    async_mgr.wait()
    assert not async_mgr.in_flight and async_mgr.saves == 1
    assert_same(manager(tmp_path / "sync").load(), manager(tmp_path / "async").load())


def test_async_failure_surfaces_at_the_next_save_with_on_error_stop(tmp_path: Path) -> None:
    mgr = manager(tmp_path, async_save=True, on_error="stop")
    unpicklable = {"model": {}, "optimizer": {}, "progress": {"step": 1}, "config": lambda: 0}
    assert mgr.save(1, unpicklable)  # copied and handed to the thread
    with pytest.raises(CheckpointError, match="step-00000001 not saved"):
        mgr.wait()
    assert mgr.failures == 1 and hidden_dirs(tmp_path) == [] and step_dirs(tmp_path) == []


def test_async_staging_buffers_are_reused_without_mixing_saves(tmp_path: Path) -> None:
    mgr = manager(tmp_path, async_save=True, keep_last=0)
    weight = torch.zeros(1000)
    state = {"model": {"w": weight, "tied": weight[:10]}, "optimizer": {}, "progress": {"step": 1}}
    assert mgr.save(1, state)
    mgr.wait_for_staging()
    weight.fill_(2.0)  # the next step changes the weights in place
    assert mgr.save(2, {**state, "progress": {"step": 2}})
    mgr.wait()
    first = manager(tmp_path, resume="step-00000001").load()["model"]
    second = manager(tmp_path, resume="step-00000002").load()["model"]
    assert first["w"].eq(0).all() and second["w"].eq(2).all()
    # The view still shares its storage with the full tensor, as in a sync save.
    assert second["tied"].untyped_storage().data_ptr() == second["w"].untyped_storage().data_ptr()


def test_only_temp_dirs_of_dead_processes_on_this_host_are_removed(tmp_path: Path) -> None:
    host = socket.gethostname()
    finished = subprocess.Popen(["true"])
    finished.wait()  # reaped: its pid names no process now
    names = [
        f".tmp-step-00000005-{host}-1",  # pid 1 is alive: maybe a save in progress
        f".tmp-step-00000006-otherhost-{finished.pid}",  # another host: cannot tell
        f".tmp-step-00000007-{host}-{finished.pid}",  # crashed save on this host
    ]
    for name in names:
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert manager(tmp_path).save(8, {"model": {}, "optimizer": {}})
    assert hidden_dirs(tmp_path) == sorted(names[:2])
    assert step_dirs(tmp_path) == ["step-00000008"]


class Counter:
    """A stateful component owning `progress.<name>` (and nothing else)."""

    def __init__(self, name: str, value: int = 0) -> None:
        self.name, self.value = name, value

    def state_dict(self) -> dict[str, Any]:
        return {"progress": {self.name: self.value}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["progress"][self.name]


def test_checkpoint_manager_saves_on_the_interval_and_rolls_back_only_what_it_should(
    tmp_path: Path,
) -> None:
    weights = {"w": torch.zeros(3)}

    class Weights:
        def state_dict(self) -> dict[str, Any]:
            return {"model": {k: v.clone() for k, v in weights.items()}, "optimizer": {}}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            weights.update(state["model"])

    step, cursor = Counter("step"), Counter("sample_index")
    store = manager(tmp_path / "run", keep_last=0)
    checkpoints = CheckpointManager(store, interval_steps=2, constants={"version": "t"})
    checkpoints.register(Weights(), rolled_back=True)
    checkpoints.register(step, rolled_back=True)
    checkpoints.register(cursor)
    # Entries of components sharing `progress` are merged; constants are saved as given.
    assert checkpoints.state_dict()["progress"] == {"step": 0, "sample_index": 0}

    saved = []
    for s in range(1, 6):
        step.value, cursor.value = s, 10 * s
        weights["w"] += 1
        saved.append(checkpoints.save(s, last=s == 5))
    assert saved == [False, True, False, True, True]
    assert not checkpoints.save(5, last=True), "a step is saved once"
    assert [i.step for i in store.run_dir.checkpoints()] == [2, 4, 5]

    path, state = checkpoints.roll_back(before_step=5)
    assert path.name == "step-00000004" and state["version"] == "t"
    assert step.value == 4 and torch.equal(weights["w"], torch.full((3,), 4.0))
    assert cursor.value == 50, "the data cursor is not rolled back"
    assert [i.step for i in store.run_dir.checkpoints()] == [2, 4]  # step 5 set aside
    assert checkpoints.roll_back(before_step=2) is None

    fresh_step, fresh_cursor = Counter("step"), Counter("sample_index")
    resumed = CheckpointManager(manager(tmp_path / "run"), 2, {})
    resumed.register(fresh_step, rolled_back=True)
    resumed.register(fresh_cursor)
    assert resumed.load()
    assert (fresh_step.value, fresh_cursor.value) == (4, 40)
    assert not resumed.save(4, last=True), "the step it resumed from is already saved"

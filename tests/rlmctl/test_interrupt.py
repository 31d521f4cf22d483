"""A launch interrupted (Ctrl-C) at each of its steps either completes, or leaves the run
resumable, or leaves the name free, and says which; nothing of it keeps running unless it
completed. The real launch code on a one-host local inventory, the real trainer under torchrun.

The report this reproduces: a Ctrl-C while `rlmctl launch` started the trainer left a run
directory and a registry entry with no hosts; `rlmctl resume` then failed ("no hosts left for
run ... after excluding") and a new launch of that name was refused.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlmctl import hostproc, lifecycle
from rlmctl.backend import LaunchRequest
from rlmctl.context import Context, Site
from rlmctl.errors import RunNotFound
from rlmctl.lifecycle import LaunchStep
from rlmctl.registry import Registry
from runcontract.rundir import RunDir
from runcontract.states import EventKind, RunState
from tests.rlmctl.conftest import REPO, assert_one_line_error, rlmctl, wait_for

TINY = REPO / "trainer/configs/tiny.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "tiny"
    subprocess.run(
        [sys.executable, "-m", "trainer", "prepare", "--out", str(out), "--seq-len", "64"],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    return out


def run_processes(run: RunDir) -> list:
    """The run's processes on this machine, found the way rlmctl's host script finds them."""
    return hostproc.run_processes({"run_dir": str(run.path), "host": "localhost"})


def interrupted_launch(local_inventory: Path, data: Path, name: str, at: LaunchStep, wait=None):
    """A launch of `name` interrupted at step `at` (after `wait()` holds, if given); what it
    said."""
    said: list[str] = []

    def on_step(step: LaunchStep) -> None:
        if step is at:
            if wait is not None:
                wait()
            raise KeyboardInterrupt

    overrides = [f"data.path={data}", "train.steps=100000", "checkpoint.interval_steps=100000"]
    with Context(Site(str(local_inventory))) as ctx, pytest.raises(KeyboardInterrupt):
        request = LaunchRequest(TINY, overrides, name)
        lifecycle.launch(ctx, lifecycle.backend_for(ctx), request, said.append, on_step)
    return said


def registry_of(local_inventory: Path) -> Registry:
    return Registry(local_inventory.parent / "shared" / "runs" / "registry.sqlite")


@pytest.mark.integration
@pytest.mark.parametrize(
    "step",
    [s for s in LaunchStep if s is not LaunchStep.DONE],
    ids=[s.name.lower() for s in LaunchStep if s is not LaunchStep.DONE],
)
def test_an_interrupted_launch_leaves_the_name_free(
    local_inventory: Path, data: Path, step: LaunchStep
) -> None:
    said = interrupted_launch(local_inventory, data, "ctrlc", step)
    assert said[-1].startswith("interrupted: "), said
    assert "free" in said[-1], said[-1]
    run = RunDir(local_inventory.parent / "shared" / "runs" / "ctrlc")
    assert not run.path.exists()
    assert run_processes(run) == []
    registry = local_inventory.parent / "shared" / "runs" / "registry.sqlite"
    if registry.exists():
        with Registry(registry) as index, pytest.raises(RunNotFound):
            index.run("ctrlc")


@pytest.mark.integration
def test_a_launch_interrupted_after_its_trainer_started_stays_resumable(
    local_inventory: Path, data: Path
) -> None:
    """Interrupted once the trainer has recorded its start: everything of it is stopped, the
    run is kept `failed` with the hosts it ran on, and `rlmctl resume` starts it again."""
    run = RunDir(local_inventory.parent / "shared" / "runs" / "late")

    def trainer_started() -> bool:
        return wait_for(
            lambda: any(e.kind == EventKind.START for e in run.events()),
            240,
            "the trainer's start",
        )

    said = interrupted_launch(local_inventory, data, "late", LaunchStep.STARTED, trainer_started)
    assert said[-1] == "interrupted: run late is kept and nothing of it runs: rlmctl resume late"
    assert run_processes(run) == []
    assert run.state() is RunState.FAILED
    with registry_of(local_inventory) as registry:
        assert [h["host"] for h in registry.hosts("late")] == ["localhost"]
    again = rlmctl("-i", str(local_inventory), "launch", "--config", str(TINY), "--name", "late")
    assert_one_line_error(again, 2, "already exists", "rlmctl resume late")
    try:
        resumed = rlmctl("-i", str(local_inventory), "resume", "late")
        assert resumed.returncode == 0, resumed.stderr
        assert "resumed late on 1 host(s): localhost" in resumed.stdout
    finally:
        stopped = rlmctl("-i", str(local_inventory), "stop", "late", "--timeout", "30")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert run_processes(run) == []


def test_a_launch_interrupted_after_it_completed_goes_on(local_inventory: Path, data: Path) -> None:
    said = interrupted_launch(local_inventory, data, "done", LaunchStep.DONE)
    assert said[-1] == "interrupted: run done was launched and goes on (rlmctl status done)"
    run = RunDir(local_inventory.parent / "shared" / "runs" / "done")
    try:
        assert run_processes(run)
        assert run.state() is RunState.LAUNCHING
    finally:
        stopped = rlmctl("-i", str(local_inventory), "stop", "done", "--timeout", "30")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert run_processes(run) == []


@pytest.mark.parametrize("name", ["", "-dash", "a/b"])
def test_an_empty_or_invalid_name_is_refused_in_one_line(local_inventory: Path, name: str) -> None:
    """`--name ""` once launched under a generated name."""
    result = rlmctl("-i", str(local_inventory), "launch", "--config", str(TINY), "--name", name)
    assert_one_line_error(result, 2, "pass another --name")
    assert not (local_inventory.parent / "shared" / "runs").exists()

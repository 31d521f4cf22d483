"""The trainer's exit codes survive the launcher: through the real torchrun, rlmctl's launcher
shell (hostproc) and rlmctl, a data error is 3 (watch does not restart it), a clean stop is 0
end to end, and a run whose trainer refused or died before it said anything does not stay
`launching`. The trainer here is a stand-in that ends the way the trainer's exit interface says
(tests/rlmctl/exit_standin.py); torchrun is the real one, which reports 1 for all three.

Each reproduces a report of issue 21: the data error reached the launcher as 1 (and watch
restarted it), the run stayed `launching`, and a clean SIGTERM stop made torchrun exit 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runcontract.rundir import RunDir, read_json
from runcontract.states import EventKind, RunState
from tests.rlmctl.conftest import REPO, rlmctl, wait_for
from tests.rlmctl.test_watch_local import start_standin

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]


def launch(local_inventory: Path, name: str, mode: str) -> RunDir:
    """The stand-in under real torchrun, started on the host as a launch starts the trainer."""
    host_argv = [*TORCHRUN, "--max-restarts=0", "-m", "tests.rlmctl.exit_standin"]
    _, run = start_standin(
        local_inventory,
        name,
        [*host_argv, f"run_dir={local_inventory.parent / 'shared' / 'runs' / name}"],
        python=sys.executable,
        cwd=str(REPO),
        env={
            "RLMCTL_RUN": str(local_inventory.parent / "shared" / "runs" / name),
            "RLMCTL_HOST": "localhost",
            "RLM_STANDIN": mode,
            "PYTHONPATH": str(REPO),
        },
    )
    return run


def exit_record(run: RunDir) -> dict:
    return wait_for(lambda: read_json(run.exit_record_path("localhost")), 120, "the exit record")


@pytest.mark.integration
def test_a_data_error_is_3_through_torchrun_and_watch_does_not_restart_it(
    local_inventory: Path,
) -> None:
    run = launch(local_inventory, "data-error", "refuse-data")
    result = rlmctl("-i", str(local_inventory), "watch", "data-error", "--poll", "0.5")
    assert result.returncode == 1, result.stderr
    assert "exit code 3 is not restartable" in result.stderr
    record = exit_record(run)
    # torchrun turned the worker's 3 into 1; the launcher shell took the trainer's own code.
    assert record["launcher_exit_code"] == 1 and record["exit_code"] == 3, record
    assert run.attempt_exit_code() == 3
    assert run.state() is RunState.FAILED and run.restarts() == 0
    assert [e.kind for e in run.events()].count(EventKind.LAUNCHED) == 1  # never relaunched


@pytest.mark.integration
def test_a_clean_stop_is_0_end_to_end(local_inventory: Path) -> None:
    run = launch(local_inventory, "clean-stop", "stop")
    wait_for(lambda: run.status().state is RunState.RUNNING, 120, "the stand-in to start")
    stopped = rlmctl("-i", str(local_inventory), "stop", "clean-stop", "--timeout", "60")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    record = exit_record(run)
    # torchrun exits 1 after it forwarded SIGTERM to a worker that exited 0.
    assert record["launcher_exit_code"] == 1 and record["exit_code"] == 0, record
    assert run.attempt_exit_code() == 0 and run.attempt_exit_codes() == [0]
    assert run.state() is RunState.STOPPED
    status = rlmctl("-i", str(local_inventory), "status", "clean-stop")
    assert status.returncode == 0, status.stdout + status.stderr


def test_a_trainer_that_dies_before_a_word_leaves_the_run_failed_not_launching(
    local_inventory: Path,
) -> None:
    run = launch(local_inventory, "silent", "silent")
    record = exit_record(run)
    assert record["exit_code"] == record["launcher_exit_code"] == 1, record
    assert run.state() is RunState.FAILED
    failed = [e for e in run.events() if e.kind == EventKind.LAUNCH_FAILED]
    assert failed and failed[0].fields["exit_code"] == 1, failed

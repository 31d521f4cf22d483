"""The run contract seen from rlmctl: the registry is an index over run directories, read commands
never write, a launch owns its name atomically, and bad input is one line that changes nothing.

Each test reproduces a report of the bad-input review (issue 15) on this machine, with the real
CLI or the real launch code and a one-host local inventory.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from clusterspec import inventory as inventory_module
from rlmctl import lifecycle
from rlmctl.backend import LaunchRequest
from rlmctl.context import Context, Site
from rlmctl.errors import RlmctlError, RunNotFound
from rlmctl.registry import Registry
from runcontract.rundir import RunDir, write_json_atomic
from runcontract.states import EventKind, RunState
from tests.rlmctl.conftest import REPO, assert_one_line_error, rlmctl

TINY = REPO / "trainer/configs/tiny.yaml"


def finished_run(local_inventory: Path, name: str, starts: int = 1) -> RunDir:
    """A run as a finished trainer leaves it, registered like `rlmctl launch` registers it."""
    host = inventory_module.load(local_inventory).select()[0]
    run = RunDir(host.runs_dir / name).create_exclusive("train: {steps: 20}\n", {"inventory": "x"})
    (run.host_dir(host.name)).mkdir(parents=True, exist_ok=True)
    run.launcher_log_path(host.name).write_text("step 20/20\n", encoding="utf-8")
    with Registry(host.runs_dir / "registry.sqlite") as registry:
        registry.add_run(name, str(run.path), str(local_inventory))
        process = {"host": host.name, "address": host.address, "pid": 2**22 + 7, "pgid": 2**22 + 7}
        registry.record_launch(name, "launch", [process], "rdzv", "127.0.0.1:29573")
    launch_record = {**process, "rdzv_id": "rdzv", "kind": "launch", "rdzv_endpoint": "x:1"}
    write_json_atomic(run.launch_record_path(host.name), launch_record)
    run.record(EventKind.LAUNCHED, kind="launch", hosts=[host.name])
    for _ in range(starts):
        run.append_event("start", step=0, world_size=2)
    run.append_event("exit", exit_code=0, state="done", step=20)
    run.write_status(state="done", step=20, max_steps=20, exit_code=0)
    return run


def snapshot(*paths: Path) -> dict[str, bytes]:
    files = {}
    for root in paths:
        for path in sorted([root] if root.is_file() else root.rglob("*")):
            if path.is_file():
                files[str(path)] = path.read_bytes()
    return files


@pytest.mark.integration
def test_read_commands_never_write(local_inventory: Path) -> None:
    run = finished_run(local_inventory, "readonly")
    registry_file = run.path.parent / "registry.sqlite"
    run.append_event("start", step=5)  # recorded running, but no process alive: status says so
    before = snapshot(run.path.parent)
    inv = str(local_inventory)
    status = rlmctl("-i", inv, "status", "readonly", "--json")
    assert status.returncode == 1, status.stderr  # active state with no live process
    assert json.loads(status.stdout)["problem"]
    for command in (["runs"], ["logs", "readonly"], ["checkpoints", "readonly"]):
        result = rlmctl("-i", inv, *command)
        assert "Traceback" not in result.stderr, result.stderr
    assert snapshot(run.path.parent) == before
    assert registry_file.is_file()


def test_restarts_mean_the_same_in_runs_and_status(local_inventory: Path) -> None:
    finished_run(local_inventory, "twice", starts=3)
    inv = str(local_inventory)
    runs = json.loads(rlmctl("-i", inv, "runs", "--json").stdout)
    status = json.loads(rlmctl("-i", inv, "status", "twice", "--json").stdout)
    assert runs[0]["restarts"] == status["restarts"] == 2


def test_stop_on_a_finished_run_does_not_rewrite_it(local_inventory: Path) -> None:
    run = finished_run(local_inventory, "finished")
    before = snapshot(run.path)
    result = rlmctl("-i", str(local_inventory), "stop", "finished", "--timeout", "5")
    assert result.returncode == 0, result.stderr
    assert "already done" in result.stdout
    assert snapshot(run.path) == before
    runs = json.loads(rlmctl("-i", str(local_inventory), "runs", "--json").stdout)
    assert runs[0]["state"] == "done"


def test_corrupt_registry_is_one_line_naming_the_file_and_the_fix(local_inventory: Path) -> None:
    run = finished_run(local_inventory, "indexed")
    registry_file = run.path.parent / "registry.sqlite"
    registry_file.write_bytes(b"this is not a database" * 100)
    result = rlmctl("-i", str(local_inventory), "runs")
    assert_one_line_error(result, 2, str(registry_file), "rlmctl reindex")
    # The registry is an index: rebuilt from the run directories, nothing lost.
    registry_file.rename(registry_file.with_suffix(".corrupt"))
    assert rlmctl("-i", str(local_inventory), "reindex").returncode == 0
    runs = json.loads(rlmctl("-i", str(local_inventory), "runs", "--json").stdout)
    assert [(r["name"], r["state"], r["hosts"]) for r in runs] == [
        ("indexed", "done", ["localhost"])
    ]


def test_a_300_character_run_name_is_one_line(local_inventory: Path) -> None:
    result = rlmctl(
        "-i", str(local_inventory), "launch", "--config", str(TINY), "--name", "r" * 300
    )
    assert_one_line_error(result, 2, "300 characters", "at most 64")
    assert list((local_inventory.parent / "shared").iterdir()) == []


def test_launch_with_micro_batch_zero_is_one_line(local_inventory: Path) -> None:
    args = ["-i", str(local_inventory), "launch", "--config", str(TINY), "--name", "zero"]
    result = rlmctl(*args, "train.micro_batch=0")
    assert_one_line_error(result, 2, "train.micro_batch")
    assert not (local_inventory.parent / "shared" / "runs" / "zero").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--params", "nan"], "--params"),
        (["--params", "inf"], "--params"),
        (["--params", "3.5e9", "--gpu-mem", "inf"], "--gpu-mem"),
        (["--params", "3.5e9", "--gpu-mem", "nan"], "--gpu-mem"),
        (["--params", "3.5e9", "--seq-len", "-4096"], "--seq-len"),
        (["--params", "3.5e9", "--micro-batch", "0"], "--micro-batch"),
    ],
)
def test_plan_rejects_impossible_numbers(args: list[str], fragment: str) -> None:
    assert_one_line_error(rlmctl("plan", *args), 2, fragment)


def test_duplicate_hosts_in_an_inventory_are_refused(tmp_path: Path) -> None:
    (tmp_path / "hosts.yml").write_text(
        "all:\n"
        "  children:\n"
        "    compute:\n"
        "      hosts:\n"
        "        node1: {ansible_host: 10.9.0.11}\n"
        "        node1-ib: {ansible_host: 10.9.0.11}\n"
        "        node2: {ansible_host: 10.9.0.12}\n",
        encoding="utf-8",
    )
    result = rlmctl("-i", str(tmp_path / "hosts.yml"), "inventory")
    assert_one_line_error(result, 2, "node1", "node1-ib", "10.9.0.11:22")


# launch ownership ---------------------------------------------------------------------------------
def launch_in_process(
    local_inventory: Path, name: str, overrides: list[str], say, on_step=None
) -> RunDir:
    with Context(Site(str(local_inventory))) as ctx:
        request = LaunchRequest(TINY, overrides, name)
        backend = lifecycle.backend_for(ctx)
        launched = lifecycle.launch(ctx, backend, request, say, on_step)
    return RunDir(launched.run_dir)


def stop_everything(local_inventory: Path, name: str) -> None:
    with Context(Site(str(local_inventory))) as ctx:
        lifecycle.stop(ctx, lifecycle.backend_for(ctx), name, timeout=5)


def test_concurrent_launches_of_one_name_leave_the_winner_intact(local_inventory: Path) -> None:
    """The second launch passes the "exists" check while the first is in its health gate."""
    data = ["data.path=/nonexistent"]  # the trainers exit at once with a data error
    second: dict[str, object] = {}

    def first_say(message: str) -> None:
        if message.startswith("health gate") and not second:
            second["run"] = launch_in_process(
                local_inventory, "race", [*data, "train.steps=60"], lambda _: None
            )

    try:
        with pytest.raises(RlmctlError, match="already exists"):
            launch_in_process(local_inventory, "race", [*data, "train.steps=30"], first_say)
    finally:
        if second:
            stop_everything(local_inventory, "race")
    run = second["run"]
    assert isinstance(run, RunDir)
    assert "steps: 60" in run.config_path.read_text(encoding="utf-8")
    with Registry(run.path.parent / "registry.sqlite") as registry:
        assert [r["name"] for r in registry.runs()] == ["race"]
        assert len(registry.launches("race")) == 1


def test_ctrl_c_after_registration_does_not_burn_the_name(local_inventory: Path) -> None:
    def interrupt_after_registration(message: str) -> None:
        if message.startswith("run ctrlc:"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch_in_process(
            local_inventory, "ctrlc", ["data.path=/nonexistent"], interrupt_after_registration
        )
    host = inventory_module.load(local_inventory).select()[0]
    assert not (host.runs_dir / "ctrlc").exists()
    with Registry(host.runs_dir / "registry.sqlite") as registry, pytest.raises(RunNotFound):
        registry.run("ctrlc")


def test_concurrent_exclusive_creates_have_one_winner(tmp_path: Path) -> None:
    """mkdir is the test-and-set: of N threads creating one run, one wins and the rest write
    nothing."""
    barrier = threading.Barrier(4)
    outcomes: list[str] = []

    def create(index: int) -> None:
        barrier.wait()
        try:
            RunDir(tmp_path / "one").create_exclusive(f"seed: {index}\n", {"by": index})
            outcomes.append(f"won {index}")
        except FileExistsError:
            outcomes.append("refused")

    threads = [threading.Thread(target=create, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1 and outcomes.count("refused") == 3
    index = winners[0].split()[1]
    assert (tmp_path / "one" / "config.yaml").read_text() == f"seed: {index}\n"
    assert RunDir(tmp_path / "one").state() is None
    assert os.listdir(tmp_path) == ["one"]


def test_state_is_recorded_in_the_run_directory(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r").create()
    assert run.record(EventKind.LAUNCHED, kind="launch")
    run.append_event("start", step=0)
    assert run.state() is RunState.RUNNING
    run.append_event("exit", state="done", exit_code=0, step=20)
    assert not run.record(EventKind.STOP_REQUESTED) and not run.record(EventKind.STOPPED)
    run.append_event("exit", state="failed", exit_code=2, step=0)  # a failed resume
    assert run.state() is RunState.DONE

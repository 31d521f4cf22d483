"""`rlmctl watch` decisions on this machine (local connection), with stand-in processes started
exactly as a launch starts them: a hang (no step progress) and a non-restartable exit code."""

from __future__ import annotations

import time
from pathlib import Path

from rlmctl import inventory
from rlmctl.launch import hostproc_command, parse_json_result, processes
from rlmctl.registry import Registry
from rlmctl.remote import Fleet
from tests.rlmctl.conftest import rlmctl
from trainer.rundir import RunDir


def start_standin(local_inventory: Path, name: str, argv: list[str]) -> tuple[Registry, RunDir]:
    host = inventory.load(local_inventory).select()[0]
    run = RunDir(host.runs_dir / name).create()
    registry = Registry(host.runs_dir / "registry.sqlite")
    registry.add_run(name, str(run.path), str(local_inventory), "")
    config = {
        "argv": argv,
        "env": {"RLMCTL_RUN": str(run.path), "RLMCTL_HOST": host.name},
        "log": str(run.launcher_log_path(host.name)),
        "exit_file": str(run.host_dir(host.name) / "exit.json"),
        "cwd": str(run.path),
    }
    with Fleet([host]) as fleet:
        (result,) = fleet.run(hostproc_command(host, "start", config))
    started = parse_json_result(result)
    assert started, result.reason
    registry.record_launch(name, "launch", [{"host": host.name, "address": "", **started}], "x", "")
    return registry, run


def test_watch_stops_a_hung_run_and_respects_the_restart_budget(local_inventory: Path) -> None:
    registry, run = start_standin(local_inventory, "hung", ["sleep", "300"])
    started = time.monotonic()
    result = rlmctl(
        "-i",
        str(local_inventory),
        "watch",
        "hung",
        "--stall",
        "3",
        "--poll",
        "0.5",
        "--restarts",
        "0",
    )
    assert result.returncode == 1, result.stderr
    assert "failure: no step progress for 3 s" in result.stderr
    assert "giving up: restart budget of 0 used up" in result.stderr
    assert time.monotonic() - started < 90
    hosts = inventory.load(local_inventory).select()
    with Fleet(hosts) as fleet:
        assert not processes(fleet, registry, "hung", run, hosts)["localhost"]["alive"]
    kinds = [e["kind"] for e in registry.events("hung")]
    assert "failure" in kinds and kinds[-1] == "state:failed"


def test_watch_gives_up_on_a_config_error_exit_code(local_inventory: Path) -> None:
    registry, _ = start_standin(local_inventory, "badcfg", ["sh", "-c", "exit 2"])
    result = rlmctl("-i", str(local_inventory), "watch", "badcfg", "--poll", "0.5")
    assert result.returncode == 1
    assert "exit code 2 is not restartable" in result.stderr
    assert registry.run("badcfg")["state"] == "failed"
    assert registry.restarts("badcfg") == []

"""`rlmctl watch` decisions on this machine (local connection), with stand-in processes started
exactly as a launch starts them: a hang (no step progress) and a non-restartable exit code."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from clusterspec import inventory
from rlmctl.backend_ssh import Backend, hostproc_command, parse_json_result
from rlmctl.context import Context, Site
from rlmctl.registry import Registry
from rlmctl.remote import Fleet
from runcontract.rundir import RunDir
from runcontract.states import EventKind, RunState
from tests.rlmctl.conftest import rlmctl


def start_standin(
    local_inventory: Path, name: str, argv: list[str], **config: object
) -> tuple[Registry, RunDir]:
    """`argv` started on the one host as an SSH launch starts torchrun (hostproc's launcher
    shell; `config` adds to what it gets, e.g. the training `python` that ends the attempt),
    recorded as a launch."""
    (host,) = inventory.load(local_inventory).select()
    return start_standins(local_inventory, name, {host.name: argv}, **config)


def start_standins(
    local_inventory: Path, name: str, argvs: dict[str, list[str]], **config: object
) -> tuple[Registry, RunDir]:
    """`start_standin` on several hosts of the inventory: per host name, its `argv`."""
    hosts = [h for h in inventory.load(local_inventory).select() if h.name in argvs]
    run = RunDir(hosts[0].runs_dir / name).create()
    registry = Registry(hosts[0].runs_dir / "registry.sqlite")
    registry.add_run(name, str(run.path), str(local_inventory))
    run.record(EventKind.LAUNCHED, launch="launch", hosts=[h.name for h in hosts])
    records = []
    with Fleet(hosts) as fleet:
        for host in hosts:
            start = {
                "run_dir": str(run.path),
                "host": host.name,
                "argv": argvs[host.name],
                "env": {"RLMCTL_RUN": str(run.path), "RLMCTL_HOST": host.name},
                "log": str(run.launcher_log_path(host.name)),
                "exit_file": str(run.exit_record_path(host.name)),
                "cwd": str(run.path),
                **config,
            }
            (result,) = fleet.run(hostproc_command(host, "start", start), hosts=[host])
            started = parse_json_result(result)
            assert started, result.reason
            records.append({"host": host.name, "address": "", **started})
    registry.record_launch(name, "launch", records, "x", "")
    return registry, run


def test_watch_stops_a_hung_run_and_respects_the_restart_budget(local_inventory: Path) -> None:
    _, run = start_standin(local_inventory, "hung", ["sleep", "300"])
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
    with Context(Site(str(local_inventory)), readonly=True) as ctx:
        assert not Backend(ctx).probe(run).alive
    kinds = [e.kind for e in run.events()]
    assert "failure" in kinds and kinds[-1] == "gave_up"
    assert run.state() is RunState.FAILED


def test_watch_gives_up_on_a_config_error_exit_code(local_inventory: Path) -> None:
    _, run = start_standin(local_inventory, "badcfg", ["sh", "-c", "exit 2"])
    result = rlmctl("-i", str(local_inventory), "watch", "badcfg", "--poll", "0.5")
    assert result.returncode == 1
    assert "exit code 2 is not restartable" in result.stderr
    assert run.state() is RunState.FAILED
    assert run.restarts() == 0


def test_watch_resumes_a_run_preempted_by_a_signal_it_did_not_send(
    local_inventory: Path,
) -> None:
    # The stand-in behaves like a trainer that got SIGTERM from a scheduler: it records a clean
    # stop before its last step and exits 0. It waits for `go` so that its status is newer than
    # the launch record.
    write_status = (
        "from runcontract.rundir import RunDir; "
        "RunDir('.').write_status(state='stopped', step=5, max_steps=10, exit_code=0)"
    )
    argv = [
        "sh",
        "-c",
        f'while [ ! -e go ]; do sleep 0.1; done; exec "{sys.executable}" -c "{write_status}"',
    ]
    _, run = start_standin(local_inventory, "preempted", argv)
    (run.path / "go").touch()
    result = rlmctl(
        "-i", str(local_inventory), "watch", "preempted", "--poll", "0.5", "--restarts", "0"
    )
    assert result.returncode == 1, result.stderr
    assert "trainer stopped on a signal at step 5 (preempted)" in result.stderr
    # Restartable: watch gets as far as its restart budget instead of giving up on exit code 0.
    assert "giving up: restart budget of 0 used up" in result.stderr
    assert any("preempted" in str(e.fields.get("reason")) for e in run.events())


def test_watch_waits_for_the_main_rank_when_another_host_finishes_first(
    local_inventory: Path,
) -> None:
    """The report: at the last step, a host without rank 0 exits 0 while rank 0 still writes the
    final checkpoint; watch called that host's end a failure, stopped rank 0 in its save and gave
    up on "exit code 0". Two hosts of this machine: `peer` ends at once with 0; `main` waits for
    that end (its exit record), says `start` more than a second later (as a rank 0 still
    importing torch under load did in a full run, which made the record look an earlier
    attempt's), then saves for a few of watch's polls and says done."""
    hosts = local_inventory / "hosts.yml"
    hosts.write_text(
        hosts.read_text().replace("        localhost:\n", "        main:\n        peer:\n"),
        encoding="utf-8",
    )
    finish = (
        "import time; "
        "from runcontract.rundir import RunDir; "
        "from runcontract.states import EventKind; "
        "run = RunDir('.'); "
        "peer = run.exit_record_path('peer'); "
        "[time.sleep(0.1) for _ in iter(lambda: peer.exists(), True)]; "
        "time.sleep(1.5); "
        "run.append_event(EventKind.START, step=0, world_size=2); "
        "run.write_status(state='running', step=10, max_steps=10); "
        "time.sleep(3); "  # the final save: several of watch's polls long
        "run.write_status(state='done', step=10, max_steps=10, exit_code=0); "
        "run.append_event(EventKind.EXIT, exit_code=0, state='done', step=10)"
    )
    argvs = {"main": [sys.executable, "-c", finish], "peer": ["sh", "-c", "exit 0"]}
    _, run = start_standins(local_inventory, "finishing", argvs)
    result = rlmctl("-i", str(local_inventory), "watch", "finishing", "--poll", "0.5")
    assert result.returncode == 0, result.stderr
    assert "run finishing done at step 10" in result.stderr
    assert run.state() is RunState.DONE
    assert not [e for e in run.events() if e.kind == EventKind.FAILURE]

"""Starting and stopping a run's processes on a host (the script rlmctl ships), on this machine.

A stand-in for torchrun: a shell whose child sits in a session of its own (like torchrun's
workers), so killing the launcher's process group alone would leave it behind.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from clusterspec.inventory import load as load_inventory
from rlmctl import hostproc
from rlmctl.backend_ssh import host_start_config
from runcontract.rundir import RunDir, read_json

TREE = "setsid sleep 300 & echo worker $!; sleep 300"


def call(action: str, cfg: dict) -> dict:
    """Run the script the way rlmctl ships it: a separate process, base64 JSON argument."""
    payload = base64.b64encode(json.dumps(cfg).encode()).decode()
    out = subprocess.run(
        [sys.executable, hostproc.__file__, action, payload],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def gone(pid: int) -> bool:
    """No such process, or a zombie waiting for its (re)parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for(condition, timeout: float):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)
    return value


def test_start_status_stop_leaves_nothing(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    ident = {"run_dir": run_dir, "host": "h1"}
    started = call(
        "start",
        ident
        | {
            "argv": ["/bin/sh", "-c", TREE],
            "env": {"RLMCTL_RUN": run_dir, "RLMCTL_HOST": "h1"},
            "log": str(tmp_path / "run/hosts/h1/launcher.log"),
            "exit_file": str(tmp_path / "run/hosts/h1/exit.json"),
            "cwd": str(tmp_path),
        },
    )
    assert started["pid"] == started["pgid"] != os.getpgid(0)  # own session and group
    log = tmp_path / "run/hosts/h1/launcher.log"
    worker = int(wait_for(lambda: log.exists() and log.read_text().split()[1:], 10)[0])
    wait_for(lambda: os.getsid(worker) == worker, 10)  # the worker left the launcher's session
    status = call("status", ident | started)
    assert status["alive"] and worker in [pid for pid, _ in status["processes"]]
    other_host = call("status", {"run_dir": run_dir, "host": "h2"})
    assert not other_host["alive"] and other_host["processes"] == []

    stopped = call("stop", ident | started | {"timeout": 5})
    assert stopped["remaining"] == [] and stopped["found"] >= 3
    assert call("status", ident | started) == {"alive": False, "processes": []}
    wait_for(lambda: gone(worker), 10)
    record = wait_for(lambda: read_json(tmp_path / "run/hosts/h1/exit.json"), 10)
    assert record["exit_code"] == 143  # SIGTERM, recorded by the launcher shell


def test_orphaned_workers_are_found_by_environment(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    ident = {"run_dir": run_dir, "host": "h1"}
    started = call(
        "start",
        ident
        | {
            "argv": ["/bin/sh", "-c", TREE],
            "env": {"RLMCTL_RUN": run_dir, "RLMCTL_HOST": "h1"},
            "log": str(tmp_path / "log"),
            "exit_file": str(tmp_path / "exit.json"),
            "cwd": str(tmp_path),
        },
    )
    worker = int(wait_for(lambda: (tmp_path / "log").read_text().split()[1:], 10)[0])
    wait_for(lambda: os.getsid(worker) == worker, 10)
    os.killpg(started["pgid"], 9)  # what a naive launcher does: the worker survives

    def only_the_orphan_left() -> bool:
        # The group dies over a few milliseconds, and a member still exiting (its environment
        # gone, its group readable) can show in one status (it flaked so). What stays is the
        # orphan: not in the group, found by its environment alone, and still the run's.
        status = call("status", ident | started)
        return not status["alive"] and [pid for pid, _ in status["processes"]] == [worker]

    wait_for(only_the_orphan_left, 10)
    stopped = call("stop", ident | started | {"timeout": 2})
    assert stopped["remaining"] == []
    wait_for(lambda: gone(worker), 10)


def test_the_start_config_rlmctl_sends_names_the_trainers_unit(local_inventory: Path) -> None:
    """On a systemd host hostproc names the transient unit from the run and host in the start
    config; `rlmctl launch` once sent neither, and every SSH launch on a provisioned node
    failed with KeyError: 'run_dir' (seen by bench/launch.py on the systemd rig)."""
    host = load_inventory(local_inventory).hosts["localhost"]
    run = RunDir(Path(host.shared_dir) / "runs" / "unit-probe")
    cfg = host_start_config(host, run, ["true"])
    # The payload travels as JSON, as it does over SSH.
    unit = hostproc.unit_name(json.loads(json.dumps(cfg)))
    assert unit.startswith("rlm-run-unit-probe-localhost-") and unit.endswith(".service"), unit


# A stand-in for torchrun and its worker: torchrun forwards the SIGTERM it gets to its worker
# (as torch.distributed.elastic does) and waits for it; the worker records every SIGTERM it gets
# and, like the trainer, treats a second one as "exit now" (trainer/train.py).
FORWARDING_LAUNCHER = r"""
import signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
def forward(signum, frame):
    worker.send_signal(signal.SIGTERM)
signal.signal(signal.SIGTERM, forward)
sys.exit(worker.wait())
"""
COUNTING_WORKER = r"""
import os, signal, sys, time
log = sys.argv[1]
def record(signum, frame):
    with open(log, "a") as f:
        f.write("TERM\n")
signal.signal(signal.SIGTERM, record)
with open(log, "a") as f:
    f.write(f"ready {os.getpid()}\n")
while open(log).read().count("TERM") == 0:
    time.sleep(0.05)
time.sleep(1.0)  # the stop's checkpoint; a second SIGTERM meanwhile would abort it
"""


def test_stop_signals_the_launcher_not_workers_it_forwards_to(tmp_path: Path) -> None:
    """A worker gets one SIGTERM from a stop, through its torchrun: signalling every process of
    the run as well gave it a second one, which the trainer takes as "exit now, no checkpoint"."""
    run_dir, log = str(tmp_path / "run"), tmp_path / "signals"
    ident = {"run_dir": run_dir, "host": "h1"}
    argv = [sys.executable, "-c", FORWARDING_LAUNCHER, COUNTING_WORKER, str(log)]
    started = call(
        "start",
        ident
        | {
            "argv": argv,
            "env": {"RLMCTL_RUN": run_dir, "RLMCTL_HOST": "h1"},
            "log": str(tmp_path / "launcher.log"),
            "exit_file": str(tmp_path / "exit.json"),
            "cwd": str(tmp_path),
        },
    )
    wait_for(lambda: log.exists() and "ready" in log.read_text(), 20)
    stopped = call("stop", ident | started | {"timeout": 10})
    assert stopped["remaining"] == [] and stopped["killed"] == [], stopped
    assert log.read_text().count("TERM") == 1, log.read_text()
    record = wait_for(lambda: read_json(tmp_path / "exit.json"), 10)
    assert record["exit_code"] == 0  # the worker finished its save and exited cleanly

"""rlmctl against the multi-host rig: real sshd, real SSH from the CLI, real torchrun/gloo.

Run as root with this helper's rig id: RLM_RIG_ID=7 .venv/bin/pytest tests/rlmctl -m rig
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from runcontract.rundir import RunDir
from tests.rlmctl.conftest import REPO, assert_one_line_error, rlmctl

pytestmark = pytest.mark.rig


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 1.0) -> Any:
    """Poll until `condition()` is truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


T0 = time.monotonic()


def mark(what: str) -> None:
    """Timeline of the long scenario (shown with pytest -s)."""
    print(f"[{time.monotonic() - T0:6.1f} s] {what}")


def health_json(inventory: Path, *extra: str) -> tuple[int, dict]:
    result = rlmctl("-i", str(inventory), "health", "--json", *extra)
    assert "Traceback" not in result.stderr
    return result.returncode, json.loads(result.stdout)


def checks_of(report: dict, host: str) -> dict[str, dict]:
    entry = next(h for h in report["hosts"] if h["host"] == host)
    return {c["name"]: c for c in entry["checks"]}


def test_health_on_three_hosts_is_ok(rig) -> None:
    code, report = health_json(rig.inventory_path)
    assert code == 0
    assert [h["host"] for h in report["hosts"]] == ["node1", "node2", "node3"]
    for host in report["hosts"]:
        # load is shared with the whole test machine and may WARN; nothing may be critical
        assert host["state"] in ("OK", "WARN"), host
        states = {c["name"]: c["state"] for c in host["checks"]}
        assert states["reachable"] == states["shared_fs"] == states["python_env"] == "OK"


def test_deep_health_all_reduces_across_the_hosts(rig) -> None:
    # One rank per host (rlm_gpus_per_node=1), torchrun over real SSH, gloo over the rig network.
    code, report = health_json(rig.inventory_path, "--deep")
    assert code == 0, report
    allreduce = report["deep"]["allreduce"]
    assert allreduce["world"] == 3 and allreduce["backend"] == "gloo" and allreduce["correct"]
    assert allreduce["busbw_gbps"] > 0 and report["deep"]["ok"]


def test_broken_hosts_are_critical_with_the_reason(make_rig, tmp_path: Path) -> None:
    rig = make_rig(4)
    shared = rig.shared_dir
    rig.exec("node2", f"umount {shared}")  # shared filesystem not mounted
    rig.exec("node3", f"mount -t tmpfs -o size=256k tmpfs {shared} && chmod 1777 {shared}")
    rig.exec("node3", f"dd if=/dev/zero of={shared}/fill bs=4k 2>/dev/null; true")  # full
    rig.stop_sshd("node4")
    # and a host that does not exist at all: the connect times out, nobody waits for it
    inventory = yaml.safe_load(rig.inventory_path.read_text())
    hosts = inventory["all"]["children"]["compute"]["hosts"]
    ghost_ip = rig.hosts[0].ip.rsplit(".", 1)[0] + ".200"
    hosts["ghost"] = hosts["node1"] | {"ansible_host": ghost_ip}
    with_ghost = tmp_path / "inventory.yml"
    with_ghost.write_text(yaml.safe_dump(inventory))
    code, report = health_json(with_ghost, "--timeout", "3")
    assert code == 1
    ghost = checks_of(report, "ghost")["reachable"]
    assert ghost["state"] == "CRIT" and "timed out" in ghost["detail"]
    assert checks_of(report, "node1")["shared_fs"]["state"] == "OK"
    assert next(h for h in report["hosts"] if h["host"] == "node1")["state"] != "CRIT"
    node2 = checks_of(report, "node2")["shared_fs"]
    assert node2["state"] == "CRIT" and "NOT the shared filesystem" in node2["detail"]
    node3 = checks_of(report, "node3")["disk"]
    assert node3["state"] == "CRIT" and "No space left on device" in node3["detail"]
    node4 = checks_of(report, "node4")["reachable"]
    assert node4["state"] == "CRIT" and "refused" in node4["detail"]
    # the human output names each broken host with its reason on one line
    text = rlmctl("-i", str(rig.inventory_path), "health").stdout
    assert "node4: reachable CRIT: unreachable: 10.250." in text


def test_unknown_host_key_is_one_clear_line(rig, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        rig.inventory_path.read_text().replace(str(rig.known_hosts_path), str(empty))
    )
    result = rlmctl("-i", str(inventory), "--limit", "node1", "health")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = [line for line in result.stdout.splitlines() if "unknown SSH host key" in line]
    assert len(lines) == 1, result.stdout
    assert "node1" in lines[0] and f"ssh-keyscan -p 22 {rig.hosts[0].ip} >> {empty}" in lines[0]


def registry_bytes(rig) -> bytes | None:
    path = rig.shared_dir / "runs" / "registry.sqlite"
    return path.read_bytes() if path.exists() else None


def test_user_errors_are_one_line(rig, tmp_path: Path) -> None:
    inv = str(rig.inventory_path)
    registry_before = registry_bytes(rig)
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [steps\n")
    assert_one_line_error(rlmctl("-i", inv, "launch", "--config", str(bad)), 2, "not valid YAML")
    config = str(REPO / "trainer/configs/tiny.yaml")
    result = rlmctl("-i", inv, "--limit", "node9", "launch", "--config", config)
    assert_one_line_error(result, 2, "node9")
    # Refused launches write nothing: no run directory, and not even the registry (the first
    # refused launch once created it).
    assert not list((rig.shared_dir / "runs").glob("bad-*"))
    assert registry_bytes(rig) == registry_before
    # "no run 'no-such-run'", or "no run registry ... yet" before any launch on the rig
    assert_one_line_error(rlmctl("-i", inv, "status", "no-such-run"), 2, "no run")


def run_processes(rig, run_dir: Path) -> list[str]:
    """Processes of the run in any host, found through the rig (not through rlmctl)."""
    found = []
    for host in rig.hosts:
        out = rig.exec(host, f"pgrep -af '[r]un_dir={run_dir}' || true").stdout.strip()
        found += [f"{host.name}: {line}" for line in out.splitlines() if line]
    return found


def worker_pid(rig, host: str, run_dir: Path) -> int:
    """A trainer worker (not torchrun) of the run on `host`, found by its environment."""
    script = (
        "import os\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        env = open(f'/proc/{pid}/environ','rb').read().split(b'\\0')\n"
        "        cmd = open(f'/proc/{pid}/cmdline','rb').read().split(b'\\0')\n"
        "    except OSError:\n"
        "        continue\n"
        f"    if b'RLMCTL_HOST={host}' in env and b'RLMCTL_RUN={run_dir}' in env "
        "and b'trainer' in cmd and b'torch.distributed.run' not in cmd:\n"
        "        print(pid)\n"
    )
    out = rig.exec(host, ["/usr/bin/python3", "-c", script]).stdout.split()
    return int(out[0]) if out else 0


def status_of(inventory: Path, run: str) -> dict:
    result = rlmctl("-i", str(inventory), "status", run, "--json")
    return json.loads(result.stdout) if result.stdout.strip() else {}


def test_launch_kill_watch_resume_stop(rig) -> None:
    inv = rig.inventory_path
    data = rig.shared_dir / "data"
    subprocess.run(
        [sys.executable, "-m", "trainer", "prepare", "--out", str(data), "--seq-len", "64"],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    mark("data prepared")
    run = f"kill-test-{int(time.time())}"
    run_dir = rig.shared_dir / "runs" / run
    overrides = ["data.path=data", "train.steps=100000", "train.global_batch=12"]
    overrides += ["train.micro_batch=2", "checkpoint.interval_steps=10", "metrics.log_every=5"]
    config = str(REPO / "trainer/configs/tiny.yaml")
    result = rlmctl("-i", str(inv), "launch", "--config", config, "--name", run, *overrides)
    assert result.returncode == 0, result.stderr
    mark("launched")
    launch = json.loads((run_dir / "hosts" / "node2" / "launch.json").read_text())
    assert launch["pgid"] == launch["pid"] and "--nnodes=3" in launch["argv"]

    # The run directory, not `rlmctl status` (~1 CPU-s a call), is polled; status is asked once.
    wait_for(
        lambda: (RunDir(run_dir).read_status().get("step") or 0) >= 20, 150, "step 20 on 3 hosts"
    )
    mark("step 20")
    status = status_of(inv, run)
    assert status["state"] == "running" and all(h["alive"] for h in status["hosts"])
    logs = rlmctl("-i", str(inv), "logs", run, "--host", "node1", "-n", "200").stdout
    assert "step 20/100000" in logs

    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlmctl",
            "-i",
            str(inv),
            "watch",
            run,
            "--poll",
            "1",
            "--backoff",
            "1",
            "--stall",
            "120",
            "--restarts",
            "2",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        victim = wait_for(lambda: worker_pid(rig, "node2", run_dir), 30, "the worker on node2")
        failed_at = RunDir(run_dir).read_status()["step"]
        rig.exec("node2", f"kill -9 {victim}")
        mark(f"killed worker {victim} on node2 at step {failed_at}")
        wait_for(lambda: RunDir(run_dir).restarts() >= 1, 120, "watch to restart the job")
        mark("restarted")
        resumed = [e for e in RunDir(run_dir).read_events() if e["event"] == "start"][-1]
        assert resumed["step"] > 0 and resumed["resumed_from"]  # from a checkpoint, not from 0
        wait_for(
            lambda: (RunDir(run_dir).read_status().get("step") or 0) > failed_at + 5,
            150,
            f"training to pass step {failed_at} again",
        )
        mark("passed the failure step")
        result = rlmctl("-i", str(inv), "stop", run, "--timeout", "30")
        assert result.returncode == 0, result.stdout + result.stderr
        output, _ = watch.communicate(timeout=60)
        mark("stopped")
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0, output
    # The survivors' collectives fail within moments of node2's worker: whether watch polls
    # before or after they exit too, it must see the failure and restart.
    assert re.search(
        r"failure: (trainer process gone on (\S+, )*node2\b|all trainer processes exited)", output
    )
    assert "restart 1/" in output
    assert run_processes(rig, run_dir) == []

    losses = [r["loss"] for r in RunDir(run_dir).read_metrics() if r.get("kind") == "train"]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5  # it learns

    # resume on two hosts: node3 left out, same global batch
    stopped_at = RunDir(run_dir).read_status()["step"]
    result = rlmctl("-i", str(inv), "--exclude", "node3", "resume", run)
    assert result.returncode == 0, result.stderr
    mark("resumed on 2 hosts")
    launch = json.loads((run_dir / "hosts" / "node1" / "launch.json").read_text())
    assert "--nnodes=2" in launch["argv"] and launch["kind"] == "resume"
    wait_for(
        lambda: (RunDir(run_dir).read_status().get("step") or 0) > stopped_at + 2,
        150,
        "training on two hosts",
    )
    starts = [e for e in RunDir(run_dir).read_events() if e["event"] == "start"]
    assert starts[-1]["world_size"] == 2
    mark("trained on 2 hosts")
    assert rlmctl("-i", str(inv), "stop", run, "--timeout", "30").returncode == 0
    assert run_processes(rig, run_dir) == []
    runs = json.loads(rlmctl("-i", str(inv), "runs", "--json").stdout)
    entry = next(r for r in runs if r["name"] == run)
    # One meaning of restarts (trainer starts after the first): watch's restart and the resume.
    assert (
        entry["state"] == "stopped"
        and entry["restarts"] == 2
        and entry["hosts"] == ["node1", "node2"]
    )
    assert status_of(inv, run)["restarts"] == 2

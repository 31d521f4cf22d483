"""`rlmctl plan` numbers and `rlmctl slurm` scripts."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterspec.inventory import load
from rlmctl import plan, slurm
from runcontract.rundir import RunDir
from runcontract.states import EventKind, RunState
from tests.rlmctl.conftest import REPO, assert_one_line_error, rlmctl


def test_param_count_matches_the_real_model() -> None:
    from trainer.model import PRESETS, RecurrentLM

    cfg = PRESETS["tiny"]
    assert plan.param_count(cfg) == RecurrentLM(cfg).param_counts().total
    huginn = plan.param_count(PRESETS["huginn-3.5b"])
    assert 3.5e9 <= huginn <= 3.6e9  # the published size


def test_estimates_behave() -> None:
    small = plan.estimate("huginn-3.5b", None, 40, None, 1)
    large = plan.estimate("huginn-3.5b", None, 141, None, 1)
    assert small.static_gib == large.static_gib
    assert abs(small.static_gib - small.params * 16 / 2**30) < 1e-6
    plain, checkpointed = small.estimates
    assert checkpointed.activations_gib < plain.activations_gib / 4
    assert large.estimates[1].min_gpus_sharded <= small.estimates[1].min_gpus_sharded
    assert large.estimates[1].unsharded_fits and not small.estimates[1].unsharded_fits
    # the rule of thumb only counts fp32 weights: it always promises fewer GPUs
    assert small.rule_of_thumb_gpus <= small.estimates[1].min_gpus_sharded
    bigger_batch = plan.estimate("huginn-3.5b", None, 40, None, 4)
    assert bigger_batch.estimates[0].activations_gib > 3.9 * plain.activations_gib - 2


def test_plan_cli() -> None:
    result = rlmctl("plan", "--params", "7e9", "--gpu-mem", "80", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["params"] == 7_000_000_000
    assert_one_line_error(rlmctl("plan", "--model", "nope"), 2, "unknown model preset")
    assert_one_line_error(rlmctl("plan"), 2, "--params")


@pytest.mark.integration
def test_slurm_script_renders_and_parses(local_inventory: Path) -> None:
    host = load(local_inventory).select()[0]
    config = REPO / "trainer/configs/tiny.yaml"
    script = slurm.render(config, "exp1", 4, 8, "gpu", "12:00:00", host)
    for line in ("#SBATCH --nodes=4", "#SBATCH --exclusive", "#SBATCH --partition=gpu"):
        assert line in script
    # CPU hosts (vendor none) have no gres/gpu to ask for; GPU hosts do.
    assert "--gpus-per-node" not in script
    gpu_host = dataclasses.replace(host, gpu_vendor="amd")
    gpu_script = slurm.render(config, "exp1", 4, 8, "gpu", "12:00:00", gpu_host, exclude=["n3"])
    assert "#SBATCH --gpus-per-node=8" in gpu_script and "#SBATCH --exclude=n3" in gpu_script
    assert f'"--rdzv-endpoint", env["head_node"] + ":{host.rdzv_port}"' in script
    assert "'--nproc-per-node', '8'" in script and "#SBATCH --signal=B:TERM@120" in script
    assert '"run_dir=" + env["RUN_DIR"]' in script and str(host.runs_dir / "exp1") in script
    # A short limit is signalled a third of it early, so the job trains before its signal.
    short = slurm.render(config, "exp1", 4, 8, "gpu", "3", host)
    assert "#SBATCH --signal=B:TERM@60" in short
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    result = rlmctl("-i", str(local_inventory), "slurm", "--config", str(config), "--nodes", "1")
    assert result.returncode == 0 and result.stdout.startswith("#!/bin/bash")
    # launch's own checks come first: a world size the config's batch does not divide is refused
    too_wide = rlmctl("-i", str(local_inventory), "slurm", "--config", str(config), "--nodes", "2")
    assert_one_line_error(too_wide, 2, "not divisible by world size")
    missing = rlmctl("-i", str(local_inventory), "slurm", "--config", "nope.yaml")
    assert_one_line_error(missing, 2, "nope.yaml")


STOPPED = {"state": "stopped", "step": 40, "max_steps": 100}


@pytest.mark.parametrize(
    ("status", "asked", "limit_signal", "requeued", "exit_code", "preempted"),
    [
        # The time-limit signal came to the batch shell, the trainer saved and stopped: requeue.
        (STOPPED, False, True, True, 0, None),
        # Stopped before its end without that signal (a peer died and srun signalled the rest,
        # or someone signalled the step): a failure for watch, not a requeue onto the same nodes.
        (STOPPED, False, False, False, 1, None),
        ({"state": "done", "step": 100, "max_steps": 100}, False, True, False, 1, None),
        # `rlmctl stop` recorded its request: the job ends, it does not requeue.
        (STOPPED, True, False, False, 1, None),
        # Preempted (squeue shows a PreemptTime since this attempt started; Slurm signalled the
        # tasks, not the shell): requeued by the script, once.
        (STOPPED, False, False, True, 0, "now"),
        # A PreemptTime from before this attempt (an earlier preemption) is not this stop's.
        (STOPPED, False, False, False, 1, "-1 hour"),
    ],
    ids=["time-limit", "peer-failed", "done", "rlmctl-stop", "preempted", "preempted-before"],
)
def test_slurm_script_requeues_only_a_run_stopped_by_the_time_limit_signal(
    local_inventory: Path,
    tmp_path: Path,
    status: dict,
    asked: bool,
    limit_signal: bool,
    requeued: bool,
    exit_code: int,
    preempted: str | None,
) -> None:
    # srun and scontrol cannot run here: stand-ins on PATH play Slurm's part. srun exits 1 the
    # way torchrun does after its workers were signalled; before that it sends the batch shell
    # the time-limit signal when Slurm would (--signal=B:TERM@120); the run directory tells
    # the rest.
    host = load(local_inventory).select()[0]
    script = slurm.render(REPO / "trainer/configs/tiny.yaml", "sl", 1, 1, None, "1:00:00", host)
    assert "#SBATCH --signal=B:TERM@120" in script
    run = RunDir(host.runs_dir / "sl").create()
    run.write_status(**status)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # While the job runs, `rlmctl stop` records its request (when asked) before signalling.
    record = (
        f"{sys.executable} -c 'from runcontract.rundir import RunDir; "
        f'RunDir("{run.path}").append_event("stop_requested")\'\n'
    )
    srun = "#!/bin/sh\n" + (record if asked else "")
    # (to the batch shell, the parent of srun's subshell)
    srun += "kill -TERM $(ps -o ppid= -p $PPID)\n" if limit_signal else ""
    (bin_dir / "srun").write_text(srun + "exit 1\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scancel.log\n')
    # squeue --Format=PreemptTime as Slurm 22.05 prints it: N/A, or a local time.
    when = f"date -d '{preempted}' +%Y-%m-%dT%H:%M:%S" if preempted else "echo N/A"
    (bin_dir / "squeue").write_text(f"#!/bin/sh\n{when}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_CPUS_ON_NODE": "2",
    }
    result = subprocess.run(["bash"], input=script, text=True, capture_output=True, env=env)
    assert result.returncode == exit_code, result.stderr
    calls = (tmp_path / "scontrol.log").read_text()
    assert ("requeue 42" in calls) is requeued
    # A requeue it asks for is an event with the reason, numbered as Slurm will count it.
    requeues = [e.fields for e in run.events() if e.kind == EventKind.REQUEUED]
    assert bool(requeues) is requeued
    if requeues:
        assert requeues[0]["restart"] == 1 and requeues[0]["job_id"] == "42"
        assert requeues[0]["reason"] == ("preempted" if preempted else "time limit")
    cancels = (tmp_path / "scancel.log").read_text().splitlines() if asked or limit_signal else []
    # The signal is passed on to the training step; a stop cancels the job once it saved.
    assert ("--signal=TERM 42" in cancels) is limit_signal
    assert ("42" in cancels) is asked


def node_wrapper(local_inventory: Path, tmp_path: Path, trainer: str) -> Path:
    """The batch script's per-node wrapper with `trainer` (a shell command) in torchrun's place."""
    host = load(local_inventory).select()[0]
    script = slurm.render(REPO / "trainer/configs/tiny.yaml", "sl", 2, 1, None, "1:00:00", host)
    body = script.split("<<'RLM_NODE_SCRIPT'\n", 1)[1].split("RLM_NODE_SCRIPT\n", 1)[0]
    line = "child = subprocess.Popen(argv)"
    assert line in body
    wrapper = tmp_path / "node.py"
    wrapper.write_text(
        body.replace(line, f"child = subprocess.Popen(['/bin/sh', '-c', {trainer!r}])")
    )
    return wrapper


def children(pid: int) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()


@pytest.mark.parametrize(
    ("trainer", "signal_it", "code", "signalled"),
    [("exit 0", False, 0, False), ("exit 3", False, 3, False), ("exec sleep 30", True, 143, True)],
    ids=["finished", "failed", "signalled"],
)
def test_the_node_wrapper_records_its_torchruns_exit(
    local_inventory: Path, tmp_path: Path, trainer: str, signal_it: bool, code: int, signalled: bool
) -> None:
    """Each node's record (hosts/<node>/exit.json) is what watch reads to find the node a job
    failed on: torchrun's exit code, when, for which job, and whether Slurm had signalled it.
    Slurm signals the task alone (the wrapper): it passes SIGTERM on to torchrun."""
    wrapper = node_wrapper(local_inventory, tmp_path, trainer)
    run_dir = tmp_path / "run"
    env = {**os.environ, "RUN_DIR": str(run_dir), "SLURMD_NODENAME": "n2", "SLURM_JOB_ID": "7"}
    env.update({"SLURM_JOB_NUM_NODES": "2", "head_node": "n1"})
    node = subprocess.Popen([sys.executable, str(wrapper)], env=env, cwd=REPO)
    if signal_it:
        deadline = time.monotonic() + 30
        while not children(node.pid):
            assert time.monotonic() < deadline, "the stand-in torchrun never started"
            time.sleep(0.05)
        node.send_signal(signal.SIGTERM)
    assert node.wait(timeout=60) == code
    record = json.loads((run_dir / "hosts/n2/exit.json").read_text())
    assert record["exit_code"] == code and record["job_id"] == "7"
    assert record["signalled"] is signalled
    assert abs(record["time"] - time.time()) < 60


@pytest.mark.parametrize(
    ("said", "code"),
    [
        ({"event": "exit", "exit_code": 0, "state": "stopped", "step": 7}, 0),
        ({"event": "start_refused", "exit_code": 3, "reason": "data missing"}, 3),
    ],
    ids=["clean-stop", "data-error"],
)
def test_the_node_wrapper_exits_with_the_trainers_own_code(
    local_inventory: Path, tmp_path: Path, said: dict, code: int
) -> None:
    """torchrun exits 1 after a clean SIGTERM stop and for a worker's data error (3): the node
    wrapper records and exits with the trainer's own code (so srun and the job do too), keeping
    torchrun's as launcher_exit_code."""
    wrapper = node_wrapper(local_inventory, tmp_path, "exit 1")
    run = RunDir(tmp_path / "run").create()
    run.append_event(EventKind.LAUNCHED, launch="launch", hosts=[], nodes=2)
    run.append_event(EventKind(said.pop("event")), **said)
    env = {**os.environ, "RUN_DIR": str(run.path), "SLURMD_NODENAME": "n2", "SLURM_JOB_ID": "7"}
    env.update({"SLURM_JOB_NUM_NODES": "2", "head_node": "n1"})
    node = subprocess.run([sys.executable, str(wrapper)], env=env, cwd=REPO, timeout=60)
    assert node.returncode == code
    record = json.loads(run.exit_record_path("n2").read_text())
    assert record["exit_code"] == code and record["launcher_exit_code"] == 1, record
    assert run.state() is not RunState.LAUNCHING


def slurm_inventory(local_inventory: Path) -> Path:
    hosts = local_inventory / "hosts.yml"
    hosts.write_text(hosts.read_text() + "    rlm_scheduler: slurm\n", encoding="utf-8")
    return local_inventory


def test_slurm_watch_of_an_unknown_run_is_one_line(local_inventory: Path) -> None:
    result = rlmctl("-i", str(slurm_inventory(local_inventory)), "watch", "some-run")
    assert_one_line_error(result, 2, "some-run")


def test_slurm_resume_of_an_unknown_run_is_one_line(local_inventory: Path) -> None:
    result = rlmctl("-i", str(slurm_inventory(local_inventory)), "resume", "some-run")
    assert_one_line_error(result, 2, "some-run")


def test_slurm_launch_without_a_controller_group_writes_nothing(local_inventory: Path) -> None:
    inventory = slurm_inventory(local_inventory)
    config = str(REPO / "trainer/configs/tiny.yaml")
    result = rlmctl("-i", str(inventory), "launch", "--config", config, "--name", "x", timeout=180)
    assert_one_line_error(result, 2, "no 'mgmt' group", "Slurm controller")
    assert not (inventory.parent / "shared" / "runs").exists()

"""The batch script at a shared Slurm site: the site's options (docs/slurm.md), ranks pinned to
the cores near their GPU, the trainer in a container image (pyxis). Render-level: the tests parse
the script rlmctl produces, and run its node wrapper with torchrun's start stubbed out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterspec.inventory import load
from rlmctl import slurm
from runcontract.states import EventKind
from tests.rlmctl.conftest import REPO, SUBMITTER, assert_one_line_error, rlmctl

CONFIG = REPO / "trainer/configs/tiny.yaml"


@pytest.fixture
def tmp_path(open_tmp_path: Path) -> Path:
    """This module's tmp_path (local_inventory's too) is one the submitter (SUBMITTER, through
    runuser: rlmctl runs as root here) may use: it runs the stand-ins and writes their logs."""
    return open_tmp_path


SITE = (
    "    rlm_slurm_account: proj42\n"
    "    rlm_slurm_qos: normal\n"
    "    rlm_slurm_reservation: maint\n"
    '    rlm_slurm_constraint: "h100&ib"\n'
    '    rlm_slurm_sbatch_options: ["--mail-type=END,FAIL", "--comment=proj-42"]\n'
    '    rlm_slurm_partition_options: {urgent: ["--qos=high"]}\n'
)


def with_vars(inventory: Path, text: str) -> Path:
    hosts = inventory / "hosts.yml"
    hosts.write_text(hosts.read_text() + text, encoding="utf-8")
    return inventory


def sbatch_lines(script: str) -> list[str]:
    return [
        line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")
    ]


def srun_line(script: str) -> str:
    return next(line.strip() for line in script.splitlines() if line.strip().startswith("srun "))


def test_site_options_follow_rlmctls_own_in_the_documented_order(local_inventory: Path) -> None:
    host = load(with_vars(local_inventory, SITE)).select()[0]
    script = slurm.render(CONFIG, "exp", 2, 2, "urgent", "1:00:00", host)
    lines = sbatch_lines(script)
    site = [
        "--account=proj42",
        "--qos=normal",
        "--reservation=maint",
        "--constraint=h100&ib",
        "--mail-type=END,FAIL",
        "--comment=proj-42",
        "--qos=high",  # the partition's entry last: sbatch keeps the last --qos
    ]
    assert lines[-len(site) :] == site, lines
    assert "--partition=urgent" in lines[: -len(site)] and "--nodes=2" in lines
    # Another partition has no entry; the command line's flags replace the inventory's values.
    flags = slurm.SiteOptions.of(host, {"account": "other", "constraint": "a100"})
    other = sbatch_lines(slurm.render(CONFIG, "exp", 2, 2, "gpu", "1:00:00", host, site=flags))
    assert (
        "--qos=high" not in other and "--account=other" in other and "--account=proj42" not in other
    )
    assert "--constraint=a100" in other and "--qos=normal" in other
    # The `&` of a constraint stays one word of an #SBATCH line (sbatch reads it, not bash).
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    # `rlmctl slurm --account` prints the same.
    shown = rlmctl("-i", str(local_inventory), "slurm", "-c", str(CONFIG), "--account", "cli9")
    assert shown.returncode == 0, shown.stderr
    assert "--account=cli9" in sbatch_lines(shown.stdout)


def test_no_site_options_means_no_site_lines(local_inventory: Path) -> None:
    host = load(local_inventory).select()[0]
    lines = sbatch_lines(slurm.render(CONFIG, "exp", 1, 2, None, "1:00:00", host))
    assert not [x for x in lines if x.split("=")[0] in ("--account", "--qos", "--reservation")]


@pytest.mark.parametrize(
    ("variables", "args", "fragments"),
    [
        (
            '    rlm_slurm_sbatch_options: ["--nodes=3"]\n',
            [],
            ["rlm_slurm_sbatch_options", "launch --nodes"],
        ),
        ('    rlm_slurm_sbatch_options: ["-N 3"]\n', [], ["rlm_slurm_sbatch_options", "--nodes"]),
        (
            '    rlm_slurm_sbatch_options: ["--output=x.log"]\n',
            [],
            ["--output", "rlm_slurm_sbatch_options"],
        ),
        ("    rlm_slurm_sbatch_options: --comment=x\n", [], ["rlm_slurm_sbatch_options", "list"]),
        ('    rlm_slurm_sbatch_options: ["mail-type=END"]\n', [], ["not one sbatch option"]),
        (
            '    rlm_slurm_partition_options: {gpu: ["--time=5"]}\n',
            [],
            ["rlm_slurm_partition_options[gpu]", "launch --time"],
        ),
        (
            '    rlm_slurm_partition_options: ["--qos=high"]\n',
            [],
            ["rlm_slurm_partition_options", "map"],
        ),
        ('    rlm_slurm_account: "proj 42"\n', [], ["rlm_slurm_account", "one word"]),
        ("", ["--qos", "hi gh"], ["--qos", "one word"]),
    ],
    ids=[
        "own-option",
        "own-short",
        "output",
        "not-a-list",
        "not-an-option",
        "partition-own",
        "partition-list",
        "account-space",
        "flag-space",
    ],
)
def test_a_bad_site_option_is_one_line_naming_it(
    local_inventory: Path, variables: str, args: list[str], fragments: list[str]
) -> None:
    with_vars(local_inventory, variables)
    result = rlmctl(
        "-i", str(local_inventory), "slurm", "-c", str(CONFIG), "--partition", "gpu", *args
    )
    assert_one_line_error(result, 2, *fragments)


def test_site_flags_under_ssh_are_one_line(local_inventory: Path) -> None:
    result = rlmctl("-i", str(local_inventory), "launch", "-c", str(CONFIG), "--account", "proj")
    assert_one_line_error(result, 2, "--account", "rlm_scheduler is ssh")
    assert not any((local_inventory.parent / "shared" / "runs").glob("*"))


def wrapper_argv(script: str, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """Run the script's node wrapper with torchrun's start replaced by printing its argv."""
    body = script.split("<<'RLM_NODE_SCRIPT'\n", 1)[1].split("RLM_NODE_SCRIPT\n", 1)[0]
    line = "child = subprocess.Popen(argv)"
    assert line in body
    shown = tmp_path / "argv.json"
    stub = (
        f"open({str(shown)!r}, 'w').write(json.dumps([argv, os.environ.get('RLM_RANK_CPUS')]))\n"
        "child = subprocess.Popen(['true'])"
    )
    wrapper = tmp_path / "node.py"
    wrapper.write_text("import json\n" + body.replace(line, stub))
    env = {**os.environ, "RUN_DIR": str(tmp_path / "run"), "SLURMD_NODENAME": "n1"}
    env["PYTHONPATH"] = str(REPO)  # the bundle, as a node has it installed
    env.update({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "head_node": "n1"})
    result = subprocess.run(
        [sys.executable, str(wrapper)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    argv, cpus = json.loads(shown.read_text())
    return argv, {"cpus": cpus or "", "out": result.stdout, "err": result.stderr}


def test_each_rank_is_pinned_to_its_share_of_the_node(
    local_inventory: Path, tmp_path: Path
) -> None:
    """The step is unbound (--cpu-bind=none: Slurm's implicit binding to one socket would squeeze
    every rank together); torchrun starts `clusterspec.binding pin -- python -m trainer` with
    the node's own plan (here: vendor none, 2 ranks share this machine's CPUs)."""
    from clusterspec.binding import parse_cpulist, plan_here

    host = load(local_inventory).select()[0]
    script = slurm.render(CONFIG, "exp", 1, 2, None, "1:00:00", host)
    srun = srun_line(script)
    assert "--cpu-bind=none" in srun and "--kill-on-bad-exit=1" in srun
    assert '"--cpus-per-task=$SLURM_CPUS_ON_NODE"' in srun  # the whole node for the one task
    argv, seen = wrapper_argv(script, tmp_path)
    expected = plan_here(2, "none")["plan"]
    assert seen["cpus"] == expected["RLM_RANK_CPUS"], seen
    lists = seen["cpus"].split(";")
    assert len(lists) == 2 and not set(parse_cpulist(lists[0])) & set(parse_cpulist(lists[1]))
    no_python = argv.index("--no-python")
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    pin = argv[no_python + 1 :]
    assert pin[1:5] == ["-m", "clusterspec.binding", "pin", "--"]
    assert pin[5:9] == [sys.executable, "-m", "trainer", "train"], pin
    assert "ranks pinned to CPUs" in seen["out"]
    # What `pin` does with that plan: rank 1's process runs on rank 1's CPUs alone.
    env = {**os.environ, "RLM_RANK_CPUS": seen["cpus"], "LOCAL_RANK": "1"}
    status = subprocess.run(
        [sys.executable, "-m", "clusterspec.binding", "pin", "--", "cat", "/proc/self/status"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    allowed = next(
        x.split(":")[1].strip() for x in status.splitlines() if x.startswith("Cpus_allowed_list")
    )
    assert parse_cpulist(allowed) == parse_cpulist(lists[1])


def test_without_a_topology_the_ranks_run_unpinned(local_inventory: Path, tmp_path: Path) -> None:
    """A node whose topology cannot be read (here: nvidia-smi missing) still trains, unpinned,
    and says why on stderr (the job's output)."""
    import dataclasses

    host = dataclasses.replace(load(local_inventory).select()[0], gpu_vendor="nvidia")
    env_path = os.environ["PATH"]
    try:
        os.environ["PATH"] = "/usr/bin:/bin"  # no nvidia-smi on this machine's PATH
        argv, seen = wrapper_argv(
            slurm.render(CONFIG, "exp", 1, 2, None, "1:00:00", host), tmp_path
        )
    finally:
        os.environ["PATH"] = env_path
    assert "--no-python" not in argv and "clusterspec.binding" not in argv
    trainer = argv.index("--max-restarts=0") + 7  # torchrun's own options, then the trainer's
    assert argv[trainer : trainer + 4] == ["-m", "trainer", "train", "--config"], argv
    assert "ranks not pinned" in seen["err"]


def test_a_container_image_runs_the_step_under_pyxis(local_inventory: Path) -> None:
    with_vars(
        local_inventory,
        "    rlm_container_image: /shared/images/rlm-trainer.sqsh\n"
        '    rlm_container_options: ["--container-env=NCCL_DEBUG"]\n',
    )
    host = load(local_inventory).select()[0]
    srun = srun_line(slurm.render(CONFIG, "exp", 2, 2, None, "1:00:00", host)).split()
    shared = host.shared_dir.rstrip("/")
    assert srun[srun.index("--cpu-bind=none") + 1 :] == [
        "--container-image=/shared/images/rlm-trainer.sqsh",
        f"--container-mounts={shared}:{shared}",
        f"--container-workdir={shared}",
        "--container-env=NCCL_DEBUG",
        "python3",  # the image's own interpreter runs the node wrapper
        '"$node_script"',
    ]


def test_a_bad_container_option_is_one_line(local_inventory: Path) -> None:
    with_vars(
        local_inventory,
        "    rlm_container_image: img.sqsh\n"
        '    rlm_container_options: ["--container-image=other.sqsh"]\n',
    )
    result = rlmctl("-i", str(local_inventory), "slurm", "-c", str(CONFIG))
    assert_one_line_error(result, 2, "rlm_container_options", "--container-image")


def slurm_site(local_inventory: Path, tmp_path: Path, squeue: str, scontrol: str, sacct: str):
    """This machine as controller (mgmt) and node under rlm_scheduler slurm, with stand-ins for
    Slurm's commands on PATH (their shell bodies given), and a run `r1` of Slurm job 42 indexed."""
    hosts = local_inventory / "hosts.yml"
    text = hosts.read_text().replace(
        "    compute:\n      hosts:\n        localhost:\n",
        "    compute:\n      hosts:\n        localhost:\n    mgmt:\n      hosts:\n        localhost:\n",
    )
    hosts.write_text(
        text + f"    rlm_scheduler: slurm\n    rlm_service_user: {SUBMITTER}\n", encoding="utf-8"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"squeue": squeue, "scontrol": scontrol, "sacct": sacct}.items():
        (bin_dir / name).write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/{name}.log\n{body}\n')
        (bin_dir / name).chmod(0o755)
    from runcontract.rundir import RunDir, write_json_atomic

    run = RunDir(local_inventory.parent / "shared" / "runs" / "r1").create()
    run.config_path.write_text(CONFIG.read_text())
    write_json_atomic(
        run.path / "slurm.json",
        {
            "job_id": "42",
            "jobs": ["42"],
            "request": {"nodes": 2, "partition": None, "time_limit": "1:00:00"},
        },
    )
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    assert rlmctl("-i", str(local_inventory), "reindex", env=env).returncode == 0
    return run, env


def watch_finished_run(local_inventory: Path, run, env: dict[str, str]):
    """`rlmctl watch r1` over a run whose trainer has finished: watch follows the Slurm job
    (the stand-ins) until it is gone, then exits 0."""
    run.append_event("start")
    run.write_status(state="done", step=100, max_steps=100)
    run.append_event(EventKind.EXIT, exit_code=0, state="done", step=100)
    result = rlmctl(
        "-i", str(local_inventory), "watch", "r1", "--poll", "0.2", env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result


def test_watch_records_a_slurm_requeue_and_lifts_its_hold(
    local_inventory: Path, tmp_path: Path
) -> None:
    """Slurm requeued job 42 after NODE_FAIL and holds it (Reason=BeginTime): watch records a
    `requeued` event with the reason once, releases the hold, and follows the job to its end."""
    released = tmp_path / "released"
    run, env = slurm_site(
        local_inventory,
        tmp_path,
        # Pending until released, then gone from the queue (sacct has it).
        squeue=f'[ -e {released} ] || echo "PENDING|(null)|BeginTime"',
        scontrol=(
            f'case "$1 $2" in\n'
            f'  "--oneliner show") [ -e {released} ] && exit 1\n'
            f'    echo "JobId=42 JobName=r1 JobState=PENDING Reason=BeginTime Restarts=1 NodeList=(null)";;\n'
            f'  "update JobId=42") touch {released};;\n'
            "esac"
        ),
        # sacct --duplicates: the run that node failed, then the requeued one; later COMPLETED.
        sacct=(
            'case "$*" in *--duplicates*) printf "NODE_FAIL\\nPENDING\\n";; '
            '*) echo "COMPLETED|0:0|n[1-2]";; esac'
        ),
    )
    result = watch_finished_run(local_inventory, run, env)
    requeues = [e for e in run.events() if e.kind == EventKind.REQUEUED]
    assert len(requeues) == 1, requeues
    assert requeues[0].fields == {
        **requeues[0].fields,
        "job_id": "42",
        "restart": 1,
        "reason": "NODE_FAIL",
    }
    assert "JobId=42 StartTime=now" in (tmp_path / "scontrol.log").read_text()
    assert "Slurm requeued job 42 (NODE_FAIL)" in result.stdout + result.stderr


def held_after_requeue(
    local_inventory: Path, tmp_path: Path, requeued_from: str, update: str | None = None
):
    """`slurm_site` with job 42 requeued once (sacct's first state `requeued_from`) and pending
    in Slurm's requeue hold (BeginTime) for its first three looks, then gone; `update` is the
    body of a stand-in `scontrol update JobId=42` (None: not expected to be called)."""
    shows = tmp_path / "shows"
    updates = f'  "update JobId=42") {update};;\n' if update is not None else ""
    return slurm_site(
        local_inventory,
        tmp_path,
        squeue=f'[ "$(wc -l < {shows} 2>/dev/null || echo 0)" -ge 4 ] || echo "PENDING|(null)|BeginTime"',
        scontrol=(
            f'case "$1 $2" in\n'
            f'  "--oneliner show") echo >> {shows}; [ "$(wc -l < {shows})" -ge 4 ] && exit 1\n'
            f'    echo "JobId=42 JobName=r1 JobState=PENDING Reason=BeginTime Restarts=1 NodeList=(null)";;\n'
            f"{updates}"
            "esac"
        ),
        sacct=(
            f'case "$*" in *--duplicates*) printf "{requeued_from}\\nPENDING\\n";; '
            '*) echo "COMPLETED|0:0|n[1-2]";; esac'
        ),
    )


def test_watch_waits_out_a_requeue_hold_slurm_will_not_lift_for_it(
    local_inventory: Path, tmp_path: Path
) -> None:
    """watch lifts a requeue hold as the job's owner (the service user); where Slurm refuses
    that, watch says so once and follows the job until Slurm starts it and it ends."""
    run, env = held_after_requeue(
        local_inventory,
        tmp_path,
        requeued_from="NODE_FAIL",
        update='echo "slurm_update error: Access/permission denied" >&2; exit 1',
    )
    result = watch_finished_run(local_inventory, run, env)
    said = result.stdout + result.stderr
    assert said.count("stays in Slurm's requeue hold") == 1, said
    assert "Access/permission denied" in said and "released job" not in said
    assert (tmp_path / "scontrol.log").read_text().count("StartTime=now") == 1


def test_watch_leaves_a_preempted_jobs_hold_to_the_preemptor(
    local_inventory: Path, tmp_path: Path
) -> None:
    """Job 42 was preempted and requeued (sacct: PREEMPTED): the preempting job needs the nodes
    first, so watch records the requeue but never starts job 42 at once (a job started at once is
    preempted again and ends FAILED, as seen on the rig); Slurm starts it when its hold ends."""
    run, env = held_after_requeue(local_inventory, tmp_path, requeued_from="PREEMPTED")
    watch_finished_run(local_inventory, run, env)
    [requeue] = [e for e in run.events() if e.kind == EventKind.REQUEUED]
    assert requeue.fields["reason"] == "PREEMPTED"
    log = tmp_path / "scontrol.log"
    assert "StartTime=now" not in (log.read_text() if log.exists() else "")


def test_status_shows_the_pending_reason_and_the_allocated_nodes(
    local_inventory: Path, tmp_path: Path
) -> None:
    _, env = slurm_site(
        local_inventory,
        tmp_path,
        squeue='echo "RUNNING|n[1-2]|None"',
        scontrol='[ "$1 $2" = "show hostnames" ] && printf "n1\\nn2\\n"',
        sacct="",
    )
    shown = rlmctl("-i", str(local_inventory), "status", "r1", "--json", env=env)
    info = json.loads(shown.stdout)
    assert [h["host"] for h in info["hosts"]] == ["n1", "n2"], shown.stdout
    (tmp_path / "bin/squeue").write_text('#!/bin/sh\necho "PENDING|(null)|Priority"\n')
    pending = rlmctl("-i", str(local_inventory), "status", "r1", env=env)
    assert "slurm job 42: PENDING (Priority)" in pending.stdout, pending.stdout


@pytest.mark.parametrize(
    ("state", "limit_signal", "code", "said"),
    [
        ("done", False, 0, "has nothing to do"),  # an earlier segment finished the run
        ("stopped", True, 0, "the next one resumes"),  # its time limit: the next segment goes on
    ],
    ids=["run-done", "time-limit"],
)
def test_a_later_segment_of_a_chain(
    local_inventory: Path, tmp_path: Path, state: str, limit_signal: bool, code: int, said: str
) -> None:
    """Segment 2 of 3 (render's `segment`; launch --segments does not submit chains yet) resumes
    from the newest checkpoint, exits at once when the run is done, and makes way for the next
    segment on its time-limit signal instead of requeueing. srun/scontrol/scancel/squeue are
    stand-ins on PATH, as in test_plan_slurm."""
    from runcontract.rundir import RunDir

    host = load(local_inventory).select()[0]
    script = slurm.render(CONFIG, "sg", 1, 1, None, "1:00:00", host, segment=2, segments=3)
    assert "RLM_RESUME=auto" in script and "segment 2 of 3" in script
    run = RunDir(host.runs_dir / "sg").create()
    run.append_event("start")
    run.write_status(state=state, step=40 if state == "stopped" else 100, max_steps=100)
    # The previous segment's trainer said its last word: done, or stopped at its time limit.
    run.append_event("exit", exit_code=0, state=state, step=40 if state == "stopped" else 100)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = f"#!/bin/sh\necho srun >> {tmp_path}/srun.log\n"
    srun += "kill -TERM $(ps -o ppid= -p $PPID)\n" if limit_signal else ""
    (bin_dir / "srun").write_text(srun + "exit 0\n")
    for tool in ("scontrol", "scancel"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/{tool}.log\n')
    (bin_dir / "squeue").write_text("#!/bin/sh\necho N/A\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n1"}
    env.update({"SLURM_JOB_ID": "43", "SLURM_JOB_NUM_NODES": "1", "SLURM_CPUS_ON_NODE": "2"})
    result = subprocess.run(["bash"], input=script, text=True, capture_output=True, env=env)
    assert result.returncode == code, result.stderr
    assert said in result.stdout, result.stdout
    assert (tmp_path / "srun.log").exists() is (state != "done")
    scontrol = tmp_path / "scontrol.log"
    assert not scontrol.exists() or "requeue" not in scontrol.read_text()
    if state != "done":
        launched = [e.fields for e in run.events() if e.kind == "launched"]
        assert launched and launched[-1]["launch"] == "segment" and launched[-1]["segment"] == 2


def test_launch_without_a_slurm_client_on_the_controller_is_one_line(
    local_inventory: Path, tmp_path: Path
) -> None:
    """The first mgmt host has squeue and friends but no sbatch: one line naming the host and
    the missing command (not "Slurm refused the job"), exit 1, nothing written."""
    _, env = slurm_site(local_inventory, tmp_path, squeue="", scontrol="", sacct="")
    assert not (tmp_path / "bin" / "sbatch").exists()
    env["PATH"] = f"{tmp_path / 'bin'}:/usr/bin:/bin"  # no sbatch anywhere (checked below)
    assert subprocess.run(["sh", "-c", "command -v sbatch"], env=env).returncode != 0
    result = rlmctl("-i", str(local_inventory), "launch", "-c", str(CONFIG), "--name", "x", env=env)
    assert_one_line_error(result, 1, "localhost", "has no sbatch", "mgmt")
    assert not (local_inventory.parent / "shared" / "runs" / "x").exists()


def test_a_stop_signals_the_trainers_not_torchrun(local_inventory: Path, tmp_path: Path) -> None:
    """Slurm's SIGTERM to the node's task goes on to torchrun's children (the trainers, which
    save and exit 0), not to torchrun, which would end in a traceback and exit 1 (a FAILED
    step in sacct after a clean stop). The stand-in torchrun notes a SIGTERM of its own."""
    import signal
    import time

    host = load(local_inventory).select()[0]
    script = slurm.render(CONFIG, "st", 2, 1, None, "1:00:00", host)
    body = script.split("<<'RLM_NODE_SCRIPT'\n", 1)[1].split("RLM_NODE_SCRIPT\n", 1)[0]
    noted = tmp_path / "torchrun-signalled"
    torchrun = f'trap "echo yes > {noted}" TERM; sleep 30 & wait $!; exit 0'
    line = "child = subprocess.Popen(argv)"
    wrapper = tmp_path / "node.py"
    wrapper.write_text(
        body.replace(line, f"child = subprocess.Popen(['/bin/sh', '-c', {torchrun!r}])")
    )
    env = {**os.environ, "RUN_DIR": str(tmp_path / "run"), "SLURMD_NODENAME": "n1"}
    env.update({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "head_node": "n1"})
    env["PYTHONPATH"] = str(REPO)
    node = subprocess.Popen([sys.executable, str(wrapper)], env=env, cwd=REPO)
    deadline = time.monotonic() + 30

    def trainer_started() -> bool:
        shells = subprocess.run(["pgrep", "-P", str(node.pid)], capture_output=True, text=True)
        return any(
            subprocess.run(["pgrep", "-P", pid], capture_output=True).returncode == 0
            for pid in shells.stdout.split()
        )

    while not trainer_started():
        assert time.monotonic() < deadline, "the stand-in trainer never started"
        time.sleep(0.05)
    node.send_signal(signal.SIGTERM)
    node.wait(timeout=60)
    assert not noted.exists(), "torchrun itself was signalled"
    record = json.loads((tmp_path / "run/hosts/n1/exit.json").read_text())
    assert record["signalled"] is True and record["exit_code"] == 0, record


def test_launch_segments_submits_a_chain_that_stop_cancels(
    local_inventory: Path, tmp_path: Path
) -> None:
    """launch --segments 3: three jobs, the 2nd and 3rd after the one before (afterany), each
    script its own segment; status follows the chain to the segment Slurm holds; stop cancels
    the pending segments before it signals the running one."""
    log = tmp_path / "scancel.log"
    _, env = slurm_site(
        local_inventory,
        tmp_path,
        # Job 101 has ended (sacct); 102 runs until cancelled; 103 waits for it.
        squeue=(
            'case "$*" in *102*) grep -qx 102 '
            + str(log)
            + ' 2>/dev/null || echo "RUNNING|n1|None";; '
            "*103*) grep -q PENDING "
            + str(log)
            + ' 2>/dev/null || echo "PENDING|(null)|Dependency";; esac'
        ),
        scontrol='[ "$1 $2" = "show hostnames" ] && echo n1; exit 0',
        sacct='echo "COMPLETED|0:0|n1"',
    )
    bin_dir = tmp_path / "bin"
    (bin_dir / "sbatch").write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path}/sbatch.log\n'
        'case "$*" in *--test-only*) cat >/dev/null; echo "sbatch: Job 1 to start" >&2; exit 0;; esac\n'
        f"n=$(cat {tmp_path}/n 2>/dev/null || echo 100); n=$((n + 1)); echo $n > {tmp_path}/n; echo $n\n"
    )
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    for tool in ("sbatch", "scancel"):
        (bin_dir / tool).chmod(0o755)
    launched = rlmctl(
        "-i", str(local_inventory), "launch", "-c", str(CONFIG), "--name", "ch",
        "--segments", "3", "--time", "30", env=env, timeout=180,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr
    run_dir = local_inventory.parent / "shared" / "runs" / "ch"
    record = json.loads((run_dir / "slurm.json").read_text())
    assert record["chain"] == ["101", "102", "103"] and record["job_id"] == "101"
    submitted = [x for x in (tmp_path / "sbatch.log").read_text().splitlines() if "--parsable" in x]
    assert "--dependency" not in submitted[0]
    assert (
        "--dependency=afterany:101" in submitted[1] and "--dependency=afterany:102" in submitted[2]
    )
    for k in (1, 2, 3):
        assert f"segment {k} of 3" in (run_dir / f"slurm-launch-1-seg{k}.sh").read_text()
    status = rlmctl("-i", str(local_inventory), "status", "ch", "--json", env=env)
    job = json.loads(status.stdout)["slurm"]
    assert job["job_id"] == "102" and job["state"] == "RUNNING", status.stdout
    stop = rlmctl("-i", str(local_inventory), "stop", "ch", "--timeout", "1", env=env, timeout=180)
    cancels = log.read_text().splitlines()
    assert cancels[0] == "--state=PENDING --name=ch", cancels
    assert "--signal=TERM 102" in cancels and "102" in cancels, cancels
    assert stop.returncode == 0, stop.stderr


def test_a_job_without_an_account_is_refused_in_one_line_naming_the_variable(
    local_inventory: Path, tmp_path: Path
) -> None:
    """A site with AccountingStorageEnforce=associations refuses a job without an account of
    the user's at submission (sbatch --test-only prints what Slurm 22.05 says); launch says so
    in one line naming rlm_slurm_account, exit 1, and writes nothing."""
    _, env = slurm_site(local_inventory, tmp_path, squeue="", scontrol="", sacct="")
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text(
        "#!/bin/sh\ncat >/dev/null\necho 'sbatch: error: Batch job submission failed: Invalid "
        "account or account/partition combination specified' >&2\nexit 1\n"
    )
    sbatch.chmod(0o755)
    result = rlmctl(
        "-i", str(local_inventory), "launch", "-c", str(CONFIG), "--name", "na", env=env
    )
    assert_one_line_error(result, 1, "Invalid account", "rlm_slurm_account", "--account")
    assert not (local_inventory.parent / "shared" / "runs" / "na").exists()


def test_a_rank_whose_cpus_are_outside_its_cpuset_still_starts() -> None:
    """`pin` with CPUs the process may not use (outside a job's cpuset; here CPU 4000) says so
    and runs the trainer unpinned rather than failing the rank."""
    env = {**os.environ, "RLM_RANK_CPUS": "4000;4001", "LOCAL_RANK": "0"}
    argv = [sys.executable, "-m", "clusterspec.binding", "pin", "--", "echo", "started"]
    result = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "started\n", result.stderr
    assert "rank 0 not pinned to CPUs 4000" in result.stderr


def test_a_container_image_runs_torchrun_in_podman_over_ssh(local_inventory: Path) -> None:
    """Over SSH the launcher runs torchrun in `podman run` of the image: host network and IPC,
    the shared directory at its path, the run's marker variables passed on by name (so status
    and stop find the container's processes as any), then rlm_container_options."""
    from rlmctl.backend_ssh import trainer_argv
    from runcontract.rundir import RunDir

    with_vars(
        local_inventory,
        "    rlm_container_image: localhost/rlm-trainer:abc\n"
        '    rlm_container_options: ["--device=/dev/kfd", "--device=/dev/dri"]\n'
        "    rlm_comm_env: {NCCL_DEBUG: WARN}\n",
    )
    host = load(local_inventory).select()[0]
    run = RunDir(host.runs_dir / "pc")
    argv = trainer_argv(host, [host], run, "pc-1", [])
    shared = host.shared_dir.rstrip("/")
    image = argv.index("localhost/rlm-trainer:abc")
    assert argv[:5] == ["podman", "run", "--rm", "--network=host", "--ipc=host"]
    head = argv[5:image]
    assert f"--volume={shared}:{shared}" in head and f"--workdir={shared}" in head
    for name in ("RLMCTL_RUN", "RLMCTL_HOST", "NCCL_DEBUG", "PYTHONUNBUFFERED"):
        assert f"--env={name}" in head
    assert head[-2:] == ["--device=/dev/kfd", "--device=/dev/dri"]
    assert argv[image + 1 : image + 4] == ["python3", "-m", "torch.distributed.run"]
    assert f"run_dir={run.path}" in argv


def test_launch_dry_run_lists_each_segment_and_the_site_options(
    local_inventory: Path, tmp_path: Path
) -> None:
    """`launch --dry-run --segments 2 --account a1` under Slurm prints both segments' scripts,
    each with the account, and writes nothing."""
    _, env = slurm_site(local_inventory, tmp_path, squeue="", scontrol="", sacct="")
    args = ["launch", "-c", str(CONFIG), "--name", "dr", "--segments", "2", "--account", "a1"]
    shown = rlmctl("-i", str(local_inventory), *args, "--dry-run", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    scripts = json.loads(shown.stdout)["commands"]
    assert sorted(scripts) == ["slurm-launch-1-seg1.sh", "slurm-launch-1-seg2.sh"], scripts
    for k, name in enumerate(sorted(scripts), 1):
        assert "--account=a1" in sbatch_lines(scripts[name])
        assert f"segment {k} of 2" in scripts[name]
    assert not (local_inventory.parent / "shared" / "runs" / "dr").exists()


def test_an_attempts_overrides_reach_the_pinned_trainer(
    local_inventory: Path, tmp_path: Path
) -> None:
    """The attempt's config overrides (watch's checkpoint interval) follow run_dir= on the
    trainer's command line, after the pin."""
    host = load(local_inventory).select()[0]
    script = slurm.render(
        CONFIG, "ov", 1, 2, None, "1:00:00", host, overrides=["checkpoint.interval_steps=7"]
    )
    argv, _ = wrapper_argv(script, tmp_path)
    assert argv[-2:] == [f"run_dir={tmp_path / 'run'}", "checkpoint.interval_steps=7"], argv


UNAVAILABLE_REFUSAL = (
    "#!/bin/sh\ncat >/dev/null\necho 'sbatch: error: Batch job submission failed: Requested node "
    "configuration is not available' >&2\nexit 1\n"
)
# sinfo --Node --format=%N|%T|%E|%P of a 3-node default partition with n3 down.
THREE_NODES_ONE_DOWN = (
    "n1|idle|none|compute*\nn2|idle|none|compute*\nn3|down*|Not responding|compute*"
)


@pytest.mark.parametrize(
    ("nodes", "fragments", "absent"),
    [
        # More than the partition has: no node's state matters, the count does.
        ("4", ["partition compute has only 3 nodes", "--nodes 3 or fewer"], "n3 is down"),
        # Nodes enough, one of them down: that node is why.
        ("3", ["n3 is down* (Not responding)", "State=RESUME"], "has only"),
    ],
    ids=["more-than-the-partition", "one-down"],
)
def test_a_refused_node_count_blames_the_partitions_size_or_its_down_node(
    local_inventory: Path, tmp_path: Path, nodes: str, fragments: list[str], absent: str
) -> None:
    """sbatch --test-only says only "Requested node configuration is not available", whether the
    partition is too small or some of its nodes are out; launch tells the two apart (sinfo)."""
    _, env = slurm_site(local_inventory, tmp_path, squeue="", scontrol="", sacct="")
    bin_dir = tmp_path / "bin"
    (bin_dir / "sbatch").write_text(UNAVAILABLE_REFUSAL)
    (bin_dir / "sinfo").write_text(f"#!/bin/sh\nprintf '%s\\n' '{THREE_NODES_ONE_DOWN}'\n")
    (bin_dir / "munge").write_text("#!/bin/sh\nexit 1\n")  # no key to compare: not asked
    for tool in ("sbatch", "sinfo", "munge"):
        (bin_dir / tool).chmod(0o755)
    argv = ["launch", "-c", str(CONFIG), "--name", "big", "--nodes", nodes]
    result = rlmctl("-i", str(local_inventory), *argv, "train.global_batch=96", env=env)
    assert_one_line_error(result, 1, "Requested node configuration is not available", *fragments)
    assert absent not in result.stderr
    assert not (local_inventory.parent / "shared" / "runs" / "big").exists()


def test_launch_submits_as_the_service_user_and_gives_it_the_run_directory(
    local_inventory: Path, tmp_path: Path
) -> None:
    """rlmctl (root here) runs every Slurm command as rlm_service_user (`nobody`): sbatch
    --test-only and sbatch see that user, and the run directory with everything in it, written
    before the job could start, belongs to it."""
    import pwd

    _, env = slurm_site(local_inventory, tmp_path, squeue="", scontrol="", sacct="")
    (tmp_path / "bin" / "sbatch").write_text(
        f'#!/bin/sh\necho "$(id -un) $*" >> {tmp_path}/sbatch.log\n'
        'case "$*" in *--test-only*) cat >/dev/null; exit 0;; esac\necho 77\n'
    )
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    launched = rlmctl(
        "-i", str(local_inventory), "launch", "-c", str(CONFIG), "--name", "su", env=env
    )
    assert launched.returncode == 0, launched.stderr
    calls = (tmp_path / "sbatch.log").read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith(f"{SUBMITTER} ") for c in calls), calls
    run_dir = local_inventory.parent / "shared" / "runs" / "su"
    nobody = pwd.getpwnam(SUBMITTER)
    owners = {
        str(p.relative_to(run_dir)): (p.lstat().st_uid, p.lstat().st_gid)
        for p in [run_dir, *run_dir.rglob("*")]
    }
    assert "slurm-launch-1.sh" in owners and "slurm.json" in owners, owners
    assert set(owners.values()) == {(nobody.pw_uid, nobody.pw_gid)}, owners


@pytest.mark.parametrize(
    ("user", "fragments"),
    [
        ("root", ["rlm_service_user is root", "never submits Slurm jobs as root"]),
        ("rlm-no-such-user", ["rlm_service_user rlm-no-such-user does not exist", "users_ssh"]),
    ],
    ids=["root", "missing"],
)
def test_no_job_is_submitted_as_root(
    local_inventory: Path, tmp_path: Path, user: str, fragments: list[str]
) -> None:
    """rlm_service_user root, or (rlmctl run as root on the controller) a service user this
    host lacks: launch is one line naming rlm_service_user; Slurm is never asked, nothing is
    written."""
    _, env = slurm_site(local_inventory, tmp_path, squeue="", scontrol="", sacct="")
    hosts = local_inventory / "hosts.yml"
    hosts.write_text(
        hosts.read_text().replace(f"rlm_service_user: {SUBMITTER}", f"rlm_service_user: {user}")
    )
    (tmp_path / "bin" / "sbatch").write_text(f"#!/bin/sh\necho called >> {tmp_path}/sbatch.log\n")
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    result = rlmctl(
        "-i", str(local_inventory), "launch", "-c", str(CONFIG), "--name", "nr", env=env
    )
    assert_one_line_error(result, 2, *fragments)
    assert not (tmp_path / "sbatch.log").exists()
    assert not (local_inventory.parent / "shared" / "runs" / "nr").exists()


def test_the_submit_host_is_reached_as_the_service_user(tmp_path: Path) -> None:
    """Over SSH the Slurm commands log in to the controller as rlm_service_user, whatever user
    the inventory (Ansible) logs in as; other commands to the same host keep that user."""
    from rlmctl.backend_slurm import Backend
    from rlmctl.context import Context, Site

    hosts = tmp_path / "hosts.yml"
    hosts.write_text(
        "all:\n  children:\n    mgmt:\n      hosts:\n        ctl:\n"
        "    compute:\n      hosts:\n        n1:\n"
        "  vars:\n    ansible_user: root\n    rlm_scheduler: slurm\n"
        "    rlm_service_user: svc\n"
    )
    with Context(Site(str(hosts))) as ctx:
        backend = Backend(ctx)
        submitter = backend.submitter()
        assert ctx.fleet.endpoint(submitter).login == "svc"
        assert ctx.fleet.endpoint(ctx.inventory.hosts["ctl"]).login == "root"
        assert backend.submit_command(submitter, "squeue") == "squeue"


@pytest.mark.skipif(os.geteuid() != 0, reason="hands files to another user: needs root")
def test_the_run_directory_goes_to_the_jobs_user_but_for_checkpoints_already_theirs(
    tmp_path: Path,
) -> None:
    """rlmctl as root gives the jobs' user the run directory on every Slurm start. It walked all
    of it: on a big run nearly every file is a checkpoint shard, written by that user already,
    each a metadata round trip on a parallel filesystem. A checkpoint of theirs is now left
    unwalked; one root made (an import, a copy) is handed over whole, as is the rest."""
    from rlmctl.backend_slurm import give_run_directory
    from runcontract.rundir import RunDir

    uid, gid = 4242, 4343  # the jobs' user; no such account is needed for lchown
    run = RunDir(tmp_path / "run").create()
    (run.path / "config.yaml").write_text("# root's\n")
    imported = run.checkpoint_path(0)  # made by root
    (imported / "dcp").mkdir(parents=True)
    (imported / "dcp" / "__0_0.distcp").write_bytes(b"shard")
    trained = run.checkpoint_path(10)  # written by the jobs
    (trained / "dcp").mkdir(parents=True)
    shard = trained / "dcp" / "__0_0.distcp"
    shard.write_bytes(b"shard")
    for path in (trained, trained / "dcp", shard):
        os.lchown(path, uid, gid)
    os.lchown(trained / "dcp", 0, 0)  # theirs would never be so; shows it is not walked

    give_run_directory(run, uid, gid)

    def owner(path: Path) -> tuple[int, int]:
        return path.lstat().st_uid, path.lstat().st_gid

    rest = [p for p in run.path.rglob("*") if not p.is_relative_to(trained)]
    assert {p: owner(p) for p in [run.path, *rest]} == {p: (uid, gid) for p in [run.path, *rest]}
    assert imported / "dcp" / "__0_0.distcp" in rest
    assert owner(trained) == (uid, gid) and owner(trained / "dcp") == (0, 0)

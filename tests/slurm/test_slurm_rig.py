"""Slurm for real on the rig: site.yml sets up slurmctld, slurmdbd + MariaDB, munge and slurmd on
1 mgmt + 3 compute systemd nodes (tests/slurm/slurm_rig.py); then the checks run against the
real daemons. One rig for the module."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from runcontract.states import EventKind, RunState
from tests.ansible.playbook_run import REPO, PlaybookRun, run_playbook, write_inventory
from tests.rig import Rig
from tests.rlmctl.conftest import rlmctl
from tests.slurm.slurm_rig import (
    ACCOUNT,
    CHECK_TAGS,
    COMPUTE,
    HEALTH_INTERVAL_S,
    NODES,
    PACED_ENV,
    QOS,
    SERVICE_UID,
    SERVICE_USER,
    SITE_TAGS,
    SLOT,
    SLURM_TAGS,
    SLURMD_TIMEOUT_S,
    URGENT,
    install_ledger_hooks,
    prepare_corpus,
    remount_cgroups_writable,
    slurm_inventory,
)
from tests.test_rig_systemd import systemd_unavailable
from trainer.rundir import RunDir, read_jsonl

pytestmark = [pytest.mark.rig, pytest.mark.timeout(1800)]


@dataclass
class Cluster:
    rig: Rig
    check: PlaybookRun
    first: PlaybookRun
    second: PlaybookRun
    first_s: float
    second_s: float
    inventory: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if reason := systemd_unavailable():
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("slurm")
    with Rig(NODES, slot=SLOT, release="bookworm") as rig:
        for name in COMPUTE:
            remount_cgroups_writable(rig, name)
        inventory = write_inventory(work / "hosts.yml", slurm_inventory(rig, work))
        check = run_playbook("site.yml", inventory, work, check=True, tags=CHECK_TAGS, timeout=600)
        started = time.monotonic()
        first = run_playbook("site.yml", inventory, work, tags=SITE_TAGS, timeout=900)
        first_s = time.monotonic() - started
        second, second_s = first, 0.0
        if first.rc == 0:
            started = time.monotonic()
            second = run_playbook("site.yml", inventory, work, tags=SLURM_TAGS, timeout=600)
            second_s = time.monotonic() - started
        print(
            f"\nsite.yml --tags {SITE_TAGS}: first run {first_s:.0f}s; "
            f"--tags {SLURM_TAGS} rerun {second_s:.0f}s"
        )
        if first.rc == 0:
            prepare_corpus(rig, REPO)
            install_ledger_hooks(rig, REPO)
        yield Cluster(rig, check, first, second, first_s, second_s, inventory)


def test_check_mode_on_bare_nodes_plans_the_packages_and_fails_nothing(cluster: Cluster) -> None:
    for host in cluster.rig.hosts:
        assert cluster.check.failures(host.name) == [], host.name
        assert cluster.check.task(host.name, "Install the Slurm packages").changed
    assert cluster.check.rc == 0, cluster.check.stderr[-2000:]


def test_site_brings_slurm_up_and_a_rerun_changes_nothing(cluster: Cluster) -> None:
    for host in cluster.rig.hosts:
        assert cluster.first.failures(host.name) == [], host.name
    assert cluster.first.rc == 0, cluster.first.stderr[-2000:]
    for host in cluster.rig.hosts:
        assert cluster.second.stats(host.name)["changed"] == 0, cluster.second.changed(host.name)
    assert cluster.second.rc == 0


def test_sinfo_shows_every_compute_node_idle(cluster: Cluster) -> None:
    assert cluster.first.rc == 0
    out = cluster.rig.exec("node1", "sinfo --noheader --Node --format='%N %P %T'").stdout
    expected = [f"{n} {p} idle" for n in COMPUTE for p in ("compute*", URGENT)]
    assert sorted(out.split("\n")[:-1]) == expected, out


def test_munge_key_is_one_key_private_to_munge(cluster: Cluster) -> None:
    assert cluster.first.rc == 0
    sums = set()
    for host in cluster.rig.hosts:
        stat = cluster.rig.exec(host, "stat -c '%a %U' /etc/munge/munge.key").stdout.split()
        assert stat == ["400", "munge"], host.name
        sums.add(cluster.rig.exec(host, "sha256sum /etc/munge/munge.key").stdout.split()[0])
    assert len(sums) == 1
    # no_log: the key's bytes never reach the play's output.
    key_tasks = [r for r in cluster.first.results if "munge key" in r.task.lower()]
    assert key_tasks and all("content" not in r.result for r in key_tasks)


def test_a_job_runs_on_compute_nodes_and_sacct_records_it(cluster: Cluster) -> None:
    assert cluster.first.rc == 0
    rig = cluster.rig
    out = rig.exec("node1", "srun --nodes=3 --ntasks-per-node=1 hostname", timeout=120).stdout
    assert sorted(out.split()) == list(COMPUTE)
    job = rig.exec("node1", "sbatch --parsable --nodes=1 --wrap 'true'").stdout.strip()
    deadline = time.monotonic() + 60
    state = ""
    while time.monotonic() < deadline:
        state = rig.exec(
            "node1", f"sacct --noheader --parsable2 --jobs {job} --format=State --allocations"
        ).stdout.strip()
        if state == "COMPLETED":
            break
        time.sleep(1)
    assert state == "COMPLETED"


def test_the_sites_account_and_qos_are_in_the_accounting_database(cluster: Cluster) -> None:
    """slurm_accounts / slurm_qos through sacctmgr (the rerun above changed nothing)."""
    assert cluster.first.rc == 0
    rows = cluster.rig.exec(
        "node1",
        "sacctmgr --noheader --parsable2 show associations "
        f"account={ACCOUNT} format=Account,User,QOS,DefaultQOS",
    ).stdout.split()
    found = {tuple(row.split("|")[:2]): row.split("|")[2:] for row in rows}
    assert set(found) == {(ACCOUNT, ""), (ACCOUNT, "rlm")}, rows
    qos_list, default_qos = found[(ACCOUNT, "rlm")]
    assert (sorted(qos_list.split(",")), default_qos) == (sorted(["normal", QOS]), "normal"), rows
    qos = cluster.rig.exec(
        "node1", f"sacctmgr --noheader --parsable2 show qos {QOS} format=MaxWall"
    )
    assert qos.stdout.split() == ["7-00:00:00"]


def test_jobs_lock_memory_without_limit_and_a_requeue_waits_cred_expire(cluster: Cluster) -> None:
    """PropagateResourceLimitsExcept=MEMLOCK: a job started from a shell with a 64 KiB memlock
    limit gets slurmd's (unlimited, for RDMA). A requeued job is held cred_expire + 1 s
    (BeginTime), the role's 60 s rather than Slurm's 120 s."""
    assert cluster.first.rc == 0
    rig = cluster.rig
    out = rig.exec("node1", "ulimit -l 64; srun --nodes=1 sh -c 'hostname; ulimit -l'", timeout=120)
    host, job_limit = out.stdout.split()
    limits = rig.exec(host, "cat /proc/$(pgrep -xo slurmd)/limits").stdout
    slurmd_limit = next(line.split()[3] for line in limits.splitlines() if "locked memory" in line)
    # /proc says bytes, ulimit KiB; the packages' unit starts slurmd with LimitMEMLOCK=infinity.
    assert job_limit == (
        "unlimited" if slurmd_limit == "unlimited" else str(int(slurmd_limit) // 1024)
    )
    assert job_limit != "64"
    job = rig.exec("node1", "sbatch --parsable --nodes=1 --output=/dev/null --wrap 'sleep 600'")
    job_id = job.stdout.strip()
    try:
        wait_for(lambda: job_state(cluster, job_id) == "RUNNING", 60, f"job {job_id} to run")
        requeued_at = int(rig.exec("node1", "date +%s").stdout)  # the controller's clock
        rig.exec("node1", f"scontrol requeue {job_id}")

        def held_until() -> str:
            fields = dict(
                field.split("=", 1)
                for field in rig.exec("node1", f"scontrol show job {job_id} -o").stdout.split()
                if "=" in field
            )
            return fields["StartTime"] if fields.get("Reason") == "BeginTime" else ""

        start = wait_for(held_until, 60, f"job {job_id} held after its requeue")
        held_s = int(rig.exec("node1", f"date -d {start} +%s").stdout) - requeued_at
        assert 55 <= held_s <= 75, held_s
    finally:
        rig.exec("node1", f"scancel {job_id}", check=False)


CONFIG = str(REPO / "trainer/configs/tiny.yaml")
TINY = ["data.path=data", "train.global_batch=8", "train.micro_batch=2", "metrics.log_every=1"]


def wait_for(
    condition: Callable[[], Any],
    timeout: float,
    what: str,
    diagnose: Callable[[], str] = lambda: "",
) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}\n{diagnose()}")
        time.sleep(1)
    return value


def status_of(cluster: Cluster, run: str, inventory: Path | None = None) -> dict:
    result = rlmctl("-i", str(inventory or cluster.inventory), "status", run, "--json")
    assert "Traceback" not in result.stderr, result.stderr
    return json.loads(result.stdout) if result.stdout.strip() else {}


# The waits below poll the run directory on the shared directory (a file read) and ask `rlmctl
# status` only once it says the awaited moment came: rlmctl status is ~1 CPU-s (a Python start,
# the inventory, squeue and sacct over SSH), and polled every second while a job ran for
# minutes it took a core of this 2-core machine from the other worker's tests.
def run_dir_of(cluster: Cluster, run: str) -> RunDir:
    """Where rlmctl keeps `run` (rlm_shared_dir/runs), seen from the test."""
    return RunDir(cluster.rig.shared_dir / "runs" / run)


def trained(cluster: Cluster, run: str) -> int:
    """The step status.json says the run has reached."""
    return run_dir_of(cluster, run).read_status().get("step") or 0


def newest_checkpoint(run_dir: RunDir) -> int:
    """The step of the run's newest checkpoint that verifies (0: none)."""
    return max((info.step for info in run_dir.checkpoints() if info.valid), default=0)


def completed(cluster: Cluster, run: str, timeout: float, inventory: Path | None = None) -> dict:
    """`rlmctl status` of `run` once its job has COMPLETED, waiting first for the run directory
    to say done."""
    run_dir = run_dir_of(cluster, run)

    def why() -> str:
        """What a wait that did not end in `done` saw: the status, the queue, the last events."""
        queue = cluster.rig.exec("node1", "squeue -a -o '%i %T %r %S %l %M'", check=False)
        events = (
            run_dir.events_path.read_text().splitlines()[-12:]
            if run_dir.events_path.exists()
            else []
        )
        return "\n".join([json.dumps(status_of(cluster, run, inventory)), queue.stdout, *events])

    ended = wait_for(
        lambda: (state := run_dir.state()) in (RunState.DONE, RunState.FAILED) and state,
        timeout,
        f"run {run} to end",
        why,
    )
    assert ended is RunState.DONE, why()
    return wait_for(
        lambda: (
            (s := status_of(cluster, run, inventory)) and s["slurm"]["state"] == "COMPLETED" and s
        ),
        60,
        f"the job of {run} to complete",
    )


def run_processes(cluster: Cluster, run_dir: Path) -> dict[str, str]:
    """Per compute node, processes whose command line names the run directory."""
    text = str(run_dir)
    pattern = f"[{text[0]}]{text[1:]}"  # matches the run's processes, not this pgrep's shell
    out = {}
    for name in COMPUTE:
        found = cluster.rig.exec(name, f"pgrep -af '{pattern}' || true").stdout.strip()
        if found:
            out[name] = found
    return out


def test_launch_trains_tiny_on_two_nodes_to_completion(cluster: Cluster) -> None:
    assert cluster.first.rc == 0
    run = "slurm-done"
    argv = ["launch", "--config", CONFIG, "--name", run, "--nodes", "2", "--json"]
    result = rlmctl("-i", str(cluster.inventory), *argv, *TINY, "train.steps=20", timeout=180)
    assert result.returncode == 0, result.stderr
    job_id = json.loads(result.stdout)["job_id"]
    final = completed(cluster, run, 240)
    assert final["state"] == "done" and final["step"] == 20, final
    assert final["slurm"]["job_id"] == job_id and final["slurm"]["exit_code"] == "0:0"
    nodes = (
        cluster.rig.exec(
            "node1", f"sacct -n -X -P -j {job_id} --format=State,NNodes,NodeList,User,Account"
        )
        .stdout.strip()
        .split("|")
    )
    assert nodes[0] == "COMPLETED" and nodes[1] == "2", nodes
    # Submitted as the service user, not as root (the inventory's SSH user); it owns the run
    # directory and everything in it: what rlmctl wrote before the job and what the job wrote.
    assert nodes[3] == SERVICE_USER, nodes
    assert nodes[4] == ACCOUNT, nodes  # rlm_slurm_account, on a site enforcing associations
    run_dir = Path(final["run_dir"])
    owners = {
        str(p.relative_to(run_dir)): (p.lstat().st_uid, p.lstat().st_gid)
        for p in [run_dir, *run_dir.rglob("*")]
    }
    assert f"slurm-{job_id}.out" in owners and "checkpoints" in owners, sorted(owners)
    others = {path: o for path, o in owners.items() if o != (SERVICE_UID, SERVICE_UID)}
    assert others == {}, others
    logs = rlmctl("-i", str(cluster.inventory), "logs", run, "-n", "500").stdout
    assert "step 20/20" in logs


def launch_and_stop(
    cluster: Cluster, run: str, steps: int, at_step: int, inventory: Path | None = None
) -> dict:
    """Launch `tiny` on 2 nodes (no interval checkpoint), `rlmctl stop` it once it reaches
    `at_step`; its status after the stop."""
    inventory = inventory or cluster.inventory
    overrides = [*TINY, f"train.steps={steps}", "checkpoint.interval_steps=1000"]
    argv = ["launch", "--config", CONFIG, "--name", run, "--nodes", "2"]
    result = rlmctl("-i", str(inventory), *argv, *overrides, timeout=180)
    assert result.returncode == 0, result.stderr
    wait_for(lambda: trained(cluster, run) >= at_step, 240, f"step {at_step}")
    stopped = rlmctl("-i", str(inventory), "stop", run, "--timeout", "90", timeout=240)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    return status_of(cluster, run, inventory)


def test_stop_mid_run_checkpoints_and_cancels(cluster: Cluster) -> None:
    assert cluster.first.rc == 0
    status = launch_and_stop(cluster, "slurm-stop", 100000, at_step=5)
    assert status["slurm"]["state"] == "CANCELLED", status
    assert status["state"] == "stopped" and status["checkpoint"]["valid"], status
    assert status["checkpoint"]["step"] >= 5  # the signal's checkpoint, not the interval's
    assert run_processes(cluster, Path(status["run_dir"])) == {}


def test_each_rank_runs_on_the_cpus_its_nodes_plan_gives_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Two ranks per node (rlm_gpus_per_node: 2 on these CPU nodes): each node's wrapper plans
    the binding from the node's own topology (clusterspec.binding; here 2 CPUs, one per rank)
    and says so in the job's output; the kernel's view of each running worker
    (/proc/<pid>/status Cpus_allowed_list) is its rank's share of the plan."""
    assert cluster.first.rc == 0
    rig, run = cluster.rig, "slurm-pinned"
    two = yaml.safe_load(cluster.inventory.read_text())
    two["all"]["vars"]["rlm_gpus_per_node"] = 2
    inventory = tmp_path / "two-ranks.yml"
    inventory.write_text(yaml.safe_dump(two))
    overrides = [*TINY, "train.steps=100000", "checkpoint.interval_steps=1000"]
    argv = ["launch", "--config", CONFIG, "--name", run, "--nodes", "2", "--json"]
    launched = rlmctl("-i", str(inventory), *argv, *overrides, timeout=180)
    assert launched.returncode == 0, launched.stderr
    job = json.loads(launched.stdout)["job_id"]
    try:
        wait_for(lambda: trained(cluster, run) >= 2, 240, "step 2")
        nodes = rig.exec("node1", f"squeue -h -j {job} -o %N").stdout.strip()
        hostnames = rig.exec("node1", f"scontrol show hostnames {nodes}").stdout.split()
        assert len(hostnames) == 2, nodes
        # Each worker (torchrun sets LOCAL_RANK) and the CPUs the kernel lets it run on.
        script = (
            "for pid in $(pgrep -f '[t]rainer train'); do "
            "lr=$(tr '\\0' '\\n' < /proc/$pid/environ | sed -n 's/^LOCAL_RANK=//p'); "
            '[ -n "$lr" ] && echo "$lr $(sed -n \'s/^Cpus_allowed_list:\\s*//p\' '
            '/proc/$pid/status)"; done; true'
        )
        output = (rig.shared_dir / "runs" / run / f"slurm-{job}.out").read_text()
        for node in hostnames:
            said = re.search(rf"^{node}: ranks pinned to CPUs (.+)$", output, re.MULTILINE)
            assert said, output[-2000:]
            plan = said.group(1).split()  # one CPU list per local rank
            assert len(plan) == 2 and plan[0] != plan[1], plan
            affinity = dict(line.split() for line in rig.exec(node, script).stdout.splitlines())
            assert affinity == {"0": plan[0], "1": plan[1]}, (node, affinity, plan)
    finally:
        rlmctl("-i", str(inventory), "stop", run, "--timeout", "90", timeout=240)


def test_resume_after_stop_finishes_in_the_same_run_directory(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The first job's steps are held back (PACED_ENV, 0.35 s each) so that it cannot end before
    the stop; the resume runs at full speed with the module's inventory."""
    assert cluster.first.rc == 0
    run, steps = "slurm-resume", 120
    before = launch_and_stop(
        cluster, run, steps, at_step=3, inventory=paced_inventory(cluster, tmp_path)
    )
    assert before["state"] == "stopped" and before["checkpoint"]["valid"], before
    assert 3 <= before["checkpoint"]["step"] < steps, before
    first_job = before["slurm"]["job_id"]

    resumed = rlmctl("-i", str(cluster.inventory), "resume", run, timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    checkpoint = f"resuming from step-{before['checkpoint']['step']:08d}"
    assert checkpoint in resumed.stderr + resumed.stdout, resumed.stderr
    final = completed(cluster, run, 300)
    assert final["slurm"]["job_id"] != first_job
    assert final["state"] == "done" and final["step"] == steps, final
    assert final["run_dir"] == before["run_dir"]
    # Every step trained exactly once over both jobs: the resume neither repeats nor skips one.
    logged = [
        r["step"] for r in RunDir(Path(final["run_dir"])).read_metrics() if r.get("kind") == "train"
    ]
    assert sorted(logged) == list(range(1, steps + 1)), logged
    again = rlmctl("-i", str(cluster.inventory), "resume", run, timeout=60)
    assert again.returncode != 0 and "is done" in again.stderr, again.stderr


def trainer_cgroups(cluster: Cluster, node: str, run_dir: Path) -> list[str]:
    """Where systemd placed every process on `node` whose command line names the run directory:
    its line of the systemd hierarchy (`0::` under cgroup v2, `name=systemd` on the rig's v1)."""
    text = str(run_dir)
    pattern = f"[{text[0]}]{text[1:]}"
    script = (
        f"for p in $(pgrep -f '{pattern}'); do"
        f" grep -E '^0::|:name=systemd:' /proc/$p/cgroup 2>/dev/null; done"
    )
    return cluster.rig.exec(node, script).stdout.split()


def test_an_ssh_launch_on_the_same_nodes_runs_in_the_trainer_slice_and_stops_clean(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The SSH launcher on provisioned systemd nodes (roles/common's rlm-trainer.slice installed):
    each host's launcher starts in a transient unit of that slice, trains, and `rlmctl stop`
    checkpoints and leaves no process. (Every SSH launch there once failed with KeyError
    'run_dir': the launch config lacked what the transient unit is named from.)"""
    assert cluster.first.rc == 0
    site = yaml.safe_load(cluster.inventory.read_text())
    site["all"]["vars"]["rlm_scheduler"] = "ssh"
    inventory = write_inventory(tmp_path / "ssh.yml", site)
    run, nodes = "ssh-on-systemd", ["node2", "node3"]
    argv = ["--limit", ",".join(nodes), "launch", "--config", CONFIG, "--name", run]
    overrides = [*TINY, "train.steps=100000", "checkpoint.interval_steps=1000"]
    result = rlmctl("-i", str(inventory), *argv, "--nodes", "2", *overrides, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    wait_for(lambda: trained(cluster, run) >= 2, 240, "step 2 of the SSH launch")
    run_dir = Path(status_of(cluster, run, inventory)["run_dir"])
    for node in nodes:
        cgroups = trainer_cgroups(cluster, node, run_dir)
        assert cgroups and all("/rlm-trainer.slice/" in c for c in cgroups), (node, cgroups)
    stopped = rlmctl("-i", str(inventory), "stop", run, "--timeout", "90", timeout=240)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    final = status_of(cluster, run, inventory)
    # The stop's own checkpoint (the interval is 1000 steps). One fresh-clone run stopped with
    # none while stop signalled torchrun's workers too: the workers' second SIGTERM (torchrun's
    # forward) made them exit without saving.
    assert final["state"] == "stopped" and final["checkpoint"]["valid"], final
    assert final["checkpoint"]["step"] >= 2
    assert run_processes(cluster, run_dir) == {}


def hostnames(cluster: Cluster, nodelist: str) -> list[str]:
    return cluster.rig.exec("node1", f"scontrol show hostnames {nodelist}").stdout.split()


def ledger_lineage(run_dir: Path) -> dict[int, list[int]]:
    """The global sample positions of each step (0-based) in the run's lineage, over every rank:
    each job's steps up to where the next one resumed (it re-trains the steps after that
    checkpoint, which the dead job's survivors may have trained already)."""
    by_step: dict[int, list[int]] = {}
    for path in sorted(run_dir.glob("ledger-rank*.jsonl")):
        attempts: list[list[dict]] = []
        for record in read_jsonl(path):
            if not attempts or record["step"] <= attempts[-1][-1]["step"]:
                attempts.append([])  # a new job started over from its checkpoint
            attempts[-1].append(record)
        for attempt, after in zip(attempts, [*attempts[1:], None], strict=True):
            end = after[0]["step"] if after else None
            for record in attempt:
                if end is None or record["step"] < end:
                    by_step.setdefault(record["step"], []).extend(record["positions"])
    return by_step


def test_watch_resubmits_without_the_failed_node_and_readmits_it_once_in_service(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The trainer SIGKILLed on one node of a 2-node job: the job fails, `watch` names that node
    (its exit record came first), resubmits with it excluded, and the run goes on from its
    checkpoint on the two other nodes with the same global batch. Then a node of that job is
    killed too: of the 3 compute nodes only the first victim is left to pair with, and Slurm has
    it idle, so watch lets it back in (one strike of two) and the run finishes there. The sample
    ledger holds every sample of the run's lineage exactly once. Steps are held back (PACED_ENV)
    so that no job can end before its kill."""
    assert cluster.first.rc == 0
    rig, run, steps = cluster.rig, "slurm-watch", 60
    inventory = paced_inventory(cluster, tmp_path)
    overrides = [*TINY, f"train.steps={steps}", "checkpoint.interval_steps=5"]
    argv = ["launch", "--config", CONFIG, "--name", run, "--nodes", "2"]
    launched = rlmctl("-i", str(inventory), *argv, *overrides, timeout=180)
    assert launched.returncode == 0, launched.stderr
    watch = ["watch", run, "--poll", "1", "--backoff", "1", "--stall", "180"]
    watcher = subprocess.Popen(
        [sys.executable, "-m", "rlmctl", "-i", str(inventory), *watch],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )

    def training(other_than: str | None, since: float) -> dict:
        """The run's status once a job other than `other_than` trains: its trainer started
        after `since` (every rank is up) and has saved 5 steps past where it started. A job
        that is RUNNING may not have started its trainer yet, and an older checkpoint proves
        nothing of the new job."""

        run_dir = run_dir_of(cluster, run)

        def saved_since_start() -> dict | None:
            events = run_dir.events()
            starts = [e.fields["step"] for e in events if e.kind == "start" and e.time > since]
            if not starts or newest_checkpoint(run_dir) < starts[-1] + 5:
                return None
            s = status_of(cluster, run, inventory)
            if not s or s["slurm"]["state"] != "RUNNING" or s["slurm"]["job_id"] == other_than:
                return None
            return s

        return wait_for(saved_since_start, 240, f"a job after {other_than} saving 5 steps")

    try:
        first = training(None, 0.0)
        victim = hostnames(cluster, first["slurm"]["nodes"])[-1]
        # torchrun and its worker; the node's wrapper (the batch script's) lives on to tell.
        killed = time.time()
        rig.exec(victim, "pkill -KILL -f '[t]rainer train'")
        second = training(first["slurm"]["job_id"], killed)
        second_nodes = hostnames(cluster, second["slurm"]["nodes"])
        assert victim not in second_nodes and len(second_nodes) == 2, (victim, second_nodes)
        victim2 = second_nodes[-1]
        rig.exec(victim2, "pkill -KILL -f '[t]rainer train'")
        output, _ = watcher.communicate(timeout=420)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.communicate()
    assert watcher.returncode == 0, output
    final = status_of(cluster, run, inventory)
    assert final["state"] == "done" and final["step"] == steps, (final, output)
    assert final["slurm"]["job_id"] not in (first["slurm"]["job_id"], second["slurm"]["job_id"])
    assert final["slurm"]["state"] == "COMPLETED", final
    third = hostnames(cluster, final["slurm"]["nodes"])
    assert victim in third and victim2 not in third and len(third) == 2, (victim, victim2, third)
    run_dir = RunDir(Path(final["run_dir"]))
    events = run_dir.events()
    failures = [e for e in events if e.kind == "failure"]
    assert [f.fields["nodes"] for f in failures] == [[victim], [victim2]], (failures, output)
    assert failures[0].fields["job_id"] == first["slurm"]["job_id"]
    assert [e.fields["hosts"] for e in events if e.kind == "excluded"] == [[victim], [victim2]]
    readmitted = [e for e in events if e.kind == "readmitted"]
    assert [e.fields["hosts"] for e in readmitted] == [[victim]], output
    assert readmitted[0].fields["strikes"] == {victim: 1}
    assert f"readmitting {victim} ({victim}: Slurm has it idle" in output, output
    # Each resumed job started from a checkpoint of the one before (interval 5), same batch.
    assert_ledger_exact(run_dir.path, steps)
    assert run_dir.restarts() >= 2


def assert_ledger_exact(run_dir: Path, steps: int, global_batch: int = 8) -> None:
    """Every global sample position of the run's lineage trained exactly once."""
    by_step = ledger_lineage(run_dir)
    assert sorted(by_step) == list(range(steps))
    for step, positions in by_step.items():
        expected = list(range(step * global_batch, (step + 1) * global_batch))
        assert sorted(positions) == expected, f"step {step}: {sorted(positions)}"


def paced_inventory(cluster: Cluster, tmp_path: Path) -> Path:
    """The module's inventory with every job's steps held back (PACED_ENV)."""
    paced = yaml.safe_load(cluster.inventory.read_text())
    paced["all"]["vars"]["rlm_comm_env"] = PACED_ENV
    inventory = tmp_path / "paced.yml"
    inventory.write_text(yaml.safe_dump(paced))
    return inventory


def assert_requeued_once_and_resumed(
    cluster: Cluster, final: dict, job: str, saved: int, steps: int
) -> None:
    """The run finished `done` in its own job, back from the queue once, resumed from the
    checkpoint the signal made, every sample of the run trained exactly once."""
    assert final["state"] == "done" and final["step"] == steps, final
    assert final["slurm"]["job_id"] == job  # the same job, back from the queue
    shown = cluster.rig.exec("node1", f"scontrol show job {job}").stdout
    assert "Restarts=1" in shown, shown
    run_dir = RunDir(Path(final["run_dir"]))
    output = (run_dir.path / f"slurm-{job}.out").read_text()
    assert "SIGTERM: stopping after this step and saving a checkpoint" in output
    starts = [r["step"] for r in read_jsonl(run_dir.path / "ledger-rank0.jsonl")]
    assert saved in starts and starts[starts.index(saved) - 1] == saved - 1  # resumed there
    assert_ledger_exact(run_dir.path, steps)


def wait_for_requeue(
    cluster: Cluster, run: str, timeout: float, what: str, diagnose: Callable[[], str]
) -> dict:
    """The run's status once its job is back in the queue (PENDING) and the trainer has
    stopped after saving."""
    run_dir = run_dir_of(cluster, run)
    return wait_for(
        lambda: (
            run_dir.state() is RunState.STOPPED
            and (s := status_of(cluster, run))
            and s["slurm"]["state"] == "PENDING"
            and s["state"] == "stopped"
            and s
        ),
        timeout,
        what,
        diagnose,
    )


def test_a_short_time_limit_checkpoints_on_the_signal_requeues_and_finishes(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`--time 3`: Slurm signals the batch shell 60 s before the limit (a third of it, up to a
    minute early), the trainers save and stop, the job requeues under its own id and resumes
    from that checkpoint. The run's steps are held back (PACED_ENV) so that it cannot end first;
    once requeued, the test lifts the limit and Slurm's requeue hold so the rest runs at once."""
    assert cluster.first.rc == 0
    rig, run, steps = cluster.rig, "slurm-time-limit", 200
    inventory = paced_inventory(cluster, tmp_path)
    overrides = [*TINY, f"train.steps={steps}", "checkpoint.interval_steps=1000"]
    argv = ["launch", "--config", CONFIG, "--name", run, "--nodes", "2", "--time", "3", "--json"]
    launched = rlmctl("-i", str(inventory), *argv, *overrides, timeout=180)
    assert launched.returncode == 0, launched.stderr
    job = json.loads(launched.stdout)["job_id"]
    requeued = wait_for_requeue(
        cluster,
        run,
        300,
        "the job requeued after the time-limit signal",
        lambda: json.dumps(status_of(cluster, run)),
    )
    saved = requeued["checkpoint"]["step"]
    assert requeued["checkpoint"]["valid"] and 0 < saved < steps, requeued
    rig.exec("node1", f"scontrol update JobId={job} TimeLimit=30 StartTime=now")
    final = completed(cluster, run, 480)
    assert_requeued_once_and_resumed(cluster, final, job, saved, steps)


def test_preemption_checkpoints_on_the_signal_requeues_and_finishes(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A job of the higher-tier partition (URGENT) that needs every compute node preempts a
    2-node run (preempt/partition_prio, PreemptMode=REQUEUE): Slurm sends the run's tasks
    SIGTERM, the trainers save and stop, the batch script sees the job's PreemptTime and
    requeues it (once: Slurm would requeue only a job still running when GraceTime ends, and
    leaves one that ended sooner FAILED, as seen on the rig before the script handled it); the
    urgent job runs, then the run resumes from that checkpoint under its own id and finishes.
    `watch` follows it throughout without a failure. Steps held back (PACED_ENV) so the run
    cannot end before the preemption; the test lifts Slurm's requeue hold."""
    assert cluster.first.rc == 0
    rig, run, steps = cluster.rig, "slurm-preempt", 60
    inventory = paced_inventory(cluster, tmp_path)
    overrides = [*TINY, f"train.steps={steps}", "checkpoint.interval_steps=1000"]
    argv = ["launch", "--config", CONFIG, "--name", run, "--nodes", "2", "--json"]
    launched = rlmctl("-i", str(inventory), *argv, *overrides, timeout=180)
    assert launched.returncode == 0, launched.stderr
    job = json.loads(launched.stdout)["job_id"]
    watch = ["watch", run, "--poll", "1", "--backoff", "1", "--stall", "300"]
    watcher = subprocess.Popen(
        [sys.executable, "-m", "rlmctl", "-i", str(inventory), *watch],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    urgent = ""
    try:
        wait_for(lambda: trained(cluster, run) >= 3, 240, "step 3")
        urgent = rig.exec(
            "node1",
            f"sbatch --parsable --partition={URGENT} --nodes={len(COMPUTE)} --exclusive "
            "--output=/dev/null --wrap true",
        ).stdout.strip()
        requeued = wait_for_requeue(
            cluster,
            run,
            180,
            "the job requeued after preemption",
            lambda: rig.exec("node1", f"scontrol show job {job}").stdout,
        )
        saved = requeued["checkpoint"]["step"]
        assert requeued["checkpoint"]["valid"] and 0 < saved < steps, requeued
        wait_for(lambda: job_gone(cluster, urgent), 120, f"the urgent job {urgent} to end")
        assert job_state(cluster, urgent) == "COMPLETED"
        rig.exec("node1", f"scontrol update JobId={job} StartTime=now")
        output, _ = watcher.communicate(timeout=480)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.communicate()
    assert watcher.returncode == 0 and "failure" not in output, output
    assert f"run {run} done at step {steps}" in output, output
    final = status_of(cluster, run)
    assert final["slurm"]["state"] == "COMPLETED", final
    assert_requeued_once_and_resumed(cluster, final, job, saved, steps)


def test_segments_run_past_the_time_limit_each_from_the_last_checkpoint(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`launch --segments 3 --time 3`: three jobs chained (afterany), each within a 3-minute
    limit. The first is signalled 60 s before it, its trainers save and it ends (COMPLETED, no
    requeue); the second starts with no operator and resumes from that checkpoint; `stop` then
    saves and cancels the running segment and cancels the pending third. The steps are held
    back (PACED_ENV) so that no segment can finish the run; the ledger holds every sample of
    the lineage exactly once."""
    assert cluster.first.rc == 0
    run = "slurm-segments"
    inventory = paced_inventory(cluster, tmp_path)
    overrides = [*TINY, "train.steps=100000", "checkpoint.interval_steps=1000"]
    argv = ["launch", "--config", CONFIG, "--name", run, "--nodes", "2", "--time", "3"]
    launched = rlmctl("-i", str(inventory), *argv, "--segments", "3", *overrides, timeout=180)
    assert launched.returncode == 0, launched.stderr
    run_dir = run_dir_of(cluster, run)
    chain = json.loads((run_dir.path / "slurm.json").read_text())["chain"]
    assert len(chain) == 3, chain

    def sacct_states() -> list[str]:
        return [job_state(cluster, job) for job in chain]

    def second_trains() -> dict | None:
        starts = [e for e in run_dir.events() if e.kind == EventKind.START]
        if len(starts) < 2 or trained(cluster, run) <= newest_checkpoint(run_dir) + 2:
            return None
        s = status_of(cluster, run, inventory)
        saved = s.get("checkpoint") or {}
        segment = s.get("slurm") or {}
        moving = segment.get("job_id") == chain[1] and s.get("state") == "running"
        return s if moving and saved.get("valid") and s["step"] > saved["step"] + 2 else None

    diagnose = lambda: f"{sacct_states()} {json.dumps(status_of(cluster, run, inventory))}"  # noqa: E731
    wait_for(
        second_trains, 420, "the second segment to train from the first's checkpoint", diagnose
    )
    first_out = (run_dir.path / f"slurm-{chain[0]}.out").read_text()
    assert "segment 1 of 3 reached its time limit: the next one resumes" in first_out, first_out
    stopped = rlmctl("-i", str(inventory), "stop", run, "--timeout", "90", timeout=240)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    final = status_of(cluster, run, inventory)
    assert final["state"] == "stopped" and final["checkpoint"]["valid"], final
    states = wait_for(
        lambda: (st := sacct_states())[2].startswith("CANCELLED") and st, 60, "the chain's end"
    )
    assert states[0] == "COMPLETED" and states[1].startswith("CANCELLED"), states
    segments = [e.fields for e in run_dir.events() if e.kind == EventKind.LAUNCHED]
    assert [f.get("segment", 1) for f in segments] == [1, 2], segments
    assert_ledger_exact(run_dir.path, final["checkpoint"]["step"])


def registry_rows(cluster: Cluster) -> list[str]:
    listed = rlmctl("-i", str(cluster.inventory), "runs", "--json")
    return [row["name"] for row in json.loads(listed.stdout or "[]")]


@pytest.mark.parametrize(
    ("args", "reason", "fix"),
    [
        (
            ["--nodes", "2", "--partition", "nope"],
            ("Invalid partition name specified",),
            "pick a partition",
        ),
        (
            ["--nodes", "4"],
            ("Node count specification invalid", "Requested node configuration is not available"),
            # The partition's size, not a node's state (all three are up).
            "partition compute has only 3 nodes; ask for --nodes 3 or fewer",
        ),
    ],
    ids=["unknown-partition", "too-many-nodes"],
)
def test_a_job_slurm_refuses_is_one_line_and_leaves_nothing(
    cluster: Cluster, args: list[str], reason: tuple[str, ...], fix: str
) -> None:
    assert cluster.first.rc == 0
    run = "slurm-refused"
    before = registry_rows(cluster)
    argv = ["launch", "--config", CONFIG, "--name", run, *args, *TINY]
    result = rlmctl("-i", str(cluster.inventory), *argv, timeout=180)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert any(text in lines[0] for text in reason) and fix in lines[0], lines[0]
    assert not (cluster.rig.shared_dir / "runs" / run).exists()
    assert registry_rows(cluster) == before


def runs_listing(cluster: Cluster) -> list[str]:
    runs = cluster.rig.shared_dir / "runs"
    return sorted(str(p.relative_to(runs)) for p in runs.rglob("*")) if runs.exists() else []


NEWCOMER = "newcomer"  # a Unix user the site never added to an account


def test_a_job_without_an_account_of_its_user_is_refused_in_one_line(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The site enforces associations (AccountingStorageEnforce=associations), as most shared
    clusters do. A submitter the accounting database does not know (no account at all) and an
    account that is not the submitter's are refused by Slurm at submission (`sbatch
    --test-only`); rlmctl says so in one line naming rlm_slurm_account, exit 1, and leaves the
    registry and the runs directory as they were. With the account (the module's inventory)
    jobs run: test_launch_trains_tiny_on_two_nodes_to_completion checks sacct's Account."""
    assert cluster.first.rc == 0
    rig = cluster.rig
    conf = rig.exec("node1", "scontrol show config").stdout
    assert any(
        line.split() == ["AccountingStorageEnforce", "=", "associations"]
        for line in conf.splitlines()
    ), [line for line in conf.splitlines() if "Enforce" in line]
    # The newcomer logs in to the controller with the operators' key, as rlm does.
    rig.exec(
        "node1",
        f"id {NEWCOMER} >/dev/null 2>&1 || useradd --create-home {NEWCOMER}; "
        f"home=$(getent passwd {NEWCOMER} | cut -d: -f6); "
        f"install -d -m 700 -o {NEWCOMER} $home/.ssh; "
        f"install -m 600 -o {NEWCOMER} $(getent passwd {SERVICE_USER} | cut -d: -f6)"
        "/.ssh/authorized_keys $home/.ssh/authorized_keys",
    )
    inventory = yaml.safe_load(cluster.inventory.read_text())
    inventory["all"]["vars"]["rlm_service_user"] = NEWCOMER
    del inventory["all"]["vars"]["rlm_slurm_account"]
    newcomers = tmp_path / "newcomer.yml"
    newcomers.write_text(yaml.safe_dump(inventory))
    before, runs = registry_rows(cluster), runs_listing(cluster)
    for path, extra in ((newcomers, []), (cluster.inventory, ["--account", "nosuch"])):
        argv = ["launch", "--config", CONFIG, "--name", "no-account", "--nodes", "2", *extra]
        result = rlmctl("-i", str(path), *argv, *TINY, timeout=180)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        assert "Invalid account" in lines[0] and "rlm_slurm_account" in lines[0], lines[0]
    assert (registry_rows(cluster), runs_listing(cluster)) == (before, runs)


def test_a_node_whose_munge_key_differs_is_down_with_the_fix_and_launch_says_so(
    cluster: Cluster,
) -> None:
    """node4 gets a munge key of its own (munge restarted there): it cannot answer slurmctld's
    pings, so Slurm sets it DOWN "Not responding" after SlurmdTimeout (SLURMD_TIMEOUT_S on the
    rig). `rlmctl health` names the key and the fix; a launch that needs node4 (3 nodes) is one
    line with both and leaves the registry and the runs directory as they were; with the
    cluster's key back node4 returns to idle by itself (ReturnToService=2), so the later tests
    of the module have all three nodes.

    What the real daemons said (Slurm 22.05.8 on this rig): node4's slurmd.log "Munge decode
    failed: Invalid credential" / "REQUEST_PING has authentication error: Invalid
    authentication credential"; slurmctld.log "[node4]:6818 failed: Zero Bytes were transmitted
    or received", then "Nodes node4 not responding, setting DOWN" (43 s after the restart);
    `sinfo`: `idle*`, then `down*` with Reason "Not responding"; `sbatch --test-only --nodes=3`:
    "allocation failure: Requested node configuration is not available"."""
    assert cluster.first.rc == 0
    rig, run = cluster.rig, "slurm-munge"
    key, kept = "/etc/munge/munge.key", "/root/munge.key.cluster"
    rig.exec("node4", f"cp -p {key} {kept} && head -c 1024 /dev/urandom >{key}")
    rig.exec("node4", "systemctl restart munge")
    try:
        state, reason = wait_for(
            lambda: (s := node_state(cluster, "node4"))[0].startswith("down") and s,
            2 * SLURMD_TIMEOUT_S + 60,
            "node4 down after its munge key changed",
            lambda: rig.exec("node1", "scontrol show node node4").stdout,
        )
        assert (state, reason) == ("down*", "Not responding")
        slurm = health_checks_of(cluster)["node4"]["slurm"]
        assert slurm["state"] == "CRIT", slurm
        assert "munge key differs from the controller's" in slurm["detail"], slurm
        assert "Invalid credential" in slurm["detail"], slurm
        assert "rerun site.yml --tags slurm" in slurm["fix"], slurm
        before = (registry_rows(cluster), runs_listing(cluster))
        # 3 nodes × 1 worker: the global batch must divide over 3 workers.
        argv = ["launch", "--config", CONFIG, "--name", run, "--nodes", "3", *TINY]
        result = rlmctl("-i", str(cluster.inventory), *argv, "train.global_batch=6", timeout=180)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        assert "Requested node configuration is not available" in lines[0], lines[0]
        assert "node4 is down* (Not responding)" in lines[0], lines[0]
        assert "munge key differs" in lines[0] and "rerun site.yml --tags slurm" in lines[0]
        assert (registry_rows(cluster), runs_listing(cluster)) == before
    finally:
        # What the role's rerun does on node4 (roles/slurm/tasks/daemons.yml), without the
        # play's minute: the controller's key back, munge restarted, and slurmd restarted since
        # it talked to a munged with another key. Restoring the key and munge alone left node4
        # down* for over 120 s in one CI run: slurmd registers again only when it restarts or
        # slurmctld's next registration request gets through.
        rig.exec(
            "node4", f"mv -f {kept} {key} && systemctl restart munge && systemctl restart slurmd"
        )
    wait_for(
        lambda: node_state(cluster, "node4")[0] == "idle",
        120,
        "node4 back in service",
        lambda: rig.exec("node1", "scontrol show node node4").stdout,
    )


def health_checks_of(cluster: Cluster) -> dict[str, dict[str, dict]]:
    """Per host, its `rlmctl health --json` checks by name."""
    result = rlmctl("-i", str(cluster.inventory), "health", "--json", timeout=180)
    assert "Traceback" not in result.stderr, result.stderr
    hosts = json.loads(result.stdout)["hosts"]
    return {h["host"]: {c["name"]: c for c in h["checks"]} for h in hosts}


def test_health_shows_slurms_drain_state_with_its_reason(cluster: Cluster) -> None:
    assert cluster.first.rc == 0
    rig = cluster.rig
    rig.exec("node1", "scontrol update NodeName=node4 State=DRAIN Reason='rig drain test'")
    try:
        drained = health_checks_of(cluster)
    finally:
        rig.exec("node1", "scontrol update NodeName=node4 State=RESUME")
    assert drained["node4"]["slurm"]["state"] == "WARN", drained["node4"]["slurm"]
    assert "rig drain test" in drained["node4"]["slurm"]["detail"]
    assert "State=RESUME" in drained["node4"]["slurm"]["fix"]
    assert all(drained[n]["slurm"]["state"] == "OK" for n in ("node2", "node3")), drained
    resumed = health_checks_of(cluster)
    assert resumed["node4"]["slurm"]["state"] == "OK", resumed["node4"]["slurm"]


HEALTH_PROGRAM = "/usr/local/sbin/rlm-node-health"


def node_state(cluster: Cluster, node: str) -> tuple[str, str]:
    """The node's state (`idle`, `drained`, ...) and reason, as sinfo says."""
    out = cluster.rig.exec(
        "node1", f"sinfo --noheader --Node --partition=compute --nodes={node} --format='%T|%300E'"
    ).stdout
    state, _, reason = out.strip().partition("|")
    return state.strip(), reason.strip()


def health_diagnostics(cluster: Cluster, node: str) -> str:
    """What slurmd and the program say on `node`, for a failure message."""
    commands = [
        "scontrol show config | grep -i -e healthcheck -e prolog -e epilog",
        "grep -i -e health -e prolog -e epilog /var/log/slurm/slurmd.log | tail -n 20",
        "journalctl -t rlm-node-health --no-pager | tail -n 20",
        f"{HEALTH_PROGRAM}; echo exit=$?",
    ]
    out = [cluster.rig.exec(node, c, check=False, timeout=90) for c in commands]
    return "\n".join(f"$ {c}\n{r.stdout}{r.stderr}" for c, r in zip(commands, out, strict=True))


# A tmpfs over the shared directory hides the controller's marker (shared_fs CRIT); owned by the
# service user as the real directory is, so that the disk check (ownership) stays OK and the
# drain reason is the marker alone.
HIDE_OPTIONS = "-o uid=$(id -u rlm),gid=$(id -g rlm),mode=0755"


def test_a_node_failing_the_health_check_drains_with_its_reason_and_resumes(
    cluster: Cluster,
) -> None:
    """Slurm runs rlmctl's host checks on every node (HealthCheckProgram): the shared directory
    hidden on node4 (a tmpfs over it) drains node4 with the check's reason, the next job runs
    elsewhere, and once the directory is back the program resumes its own drain."""
    assert cluster.first.rc == 0
    rig, shared = cluster.rig, str(cluster.rig.shared_dir)
    waited = 4 * HEALTH_INTERVAL_S + 30
    assert rig.exec("node4", f"{HEALTH_PROGRAM} --gate", check=False).returncode == 0
    with health_checks_every(cluster, HEALTH_INTERVAL_S):
        rig.exec("node4", f"mount -t tmpfs {HIDE_OPTIONS} rlm-hidden {shared}")
        try:
            _, reason = wait_for(
                lambda: (s := node_state(cluster, "node4"))[0].startswith("drain") and s,
                waited,
                "node4 drained by its health check",
                lambda: health_diagnostics(cluster, "node4"),
            )
            assert reason.startswith("rlm-health: shared_fs CRIT: "), reason
            assert "NOT the shared filesystem" in reason, reason
            gate = rig.exec("node4", f"{HEALTH_PROGRAM} --gate", check=False)
            assert gate.returncode == 1 and "shared_fs CRIT" in gate.stderr, gate.stderr
            ran = rig.exec("node1", "srun --nodes=2 hostname", timeout=120).stdout
            assert sorted(ran.split()) == ["node2", "node3"], ran
        finally:
            rig.exec("node4", f"umount {shared}")
        wait_for(lambda: node_state(cluster, "node4")[0] == "idle", waited, "node4 resumed")


def test_the_health_check_leaves_an_operators_drain_alone(cluster: Cluster) -> None:
    assert cluster.first.rc == 0
    rig = cluster.rig
    rig.exec("node3", "scontrol update NodeName=node3 State=DRAIN Reason='operator: cabling'")
    try:
        rig.exec("node3", HEALTH_PROGRAM)  # a healthy node: it resumes only its own drains
        assert node_state(cluster, "node3") == ("drained", "operator: cabling")
    finally:
        rig.exec("node1", "scontrol update NodeName=node3 State=RESUME")
    wait_for(lambda: node_state(cluster, "node3")[0] == "idle", 30, "node3 resumed")


def set_health_interval(cluster: Cluster, seconds: int) -> None:
    """HealthCheckInterval in every node's slurm.conf, applied with `scontrol reconfigure`."""
    for host in cluster.rig.hosts:
        cluster.rig.exec(
            host,
            f"sed -i 's/^HealthCheckInterval=.*/HealthCheckInterval={seconds}/' "
            "/etc/slurm/slurm.conf",
        )
    cluster.rig.exec("node1", "scontrol reconfigure")


@contextlib.contextmanager
def health_checks_every(cluster: Cluster, seconds: int) -> Iterator[None]:
    """The periodic health check every `seconds` (0: off) while the block runs; then the
    interval the role deployed again."""
    deployed = cluster.rig.exec(
        "node1", "sed -n 's/^HealthCheckInterval=//p' /etc/slurm/slurm.conf"
    ).stdout.strip()
    set_health_interval(cluster, seconds)
    try:
        yield
    finally:
        set_health_interval(cluster, int(deployed))


def job_state(cluster: Cluster, job: str) -> str:
    out = cluster.rig.exec(
        "node1", f"sacct --noheader --parsable2 --allocations --jobs {job} --format=State"
    ).stdout.strip()
    return out.split()[0] if out else ""


def test_the_prolog_gate_drains_a_failing_node_and_the_job_does_not_run_there(
    cluster: Cluster,
) -> None:
    """With the periodic check off, only the Prolog can see node4's hidden shared directory: the
    job asked onto node4 drains it with the check's reason and goes back to the queue."""
    assert cluster.first.rc == 0
    rig, shared = cluster.rig, str(cluster.rig.shared_dir)
    job = ""
    with health_checks_every(cluster, 0):
        try:
            rig.exec("node4", f"mount -t tmpfs {HIDE_OPTIONS} rlm-hidden {shared}")
            job = rig.exec(
                "node1", "sbatch --parsable --nodelist=node4 --output=/dev/null --wrap 'hostname'"
            ).stdout.strip()
            _, reason = wait_for(
                lambda: (s := node_state(cluster, "node4"))[0].startswith("drain") and s,
                120,
                "node4 drained by the prolog",
                lambda: health_diagnostics(cluster, "node4"),
            )
            assert reason.startswith("rlm-health: shared_fs CRIT: "), reason
            queued = rig.exec("node1", f"squeue --noheader --jobs {job} --format=%T").stdout
            assert queued.strip() == "PENDING", queued  # requeued by the failed prolog, not run
            assert job_state(cluster, job) != "COMPLETED"
        finally:
            if job:
                rig.exec("node1", f"scancel {job}", check=False)
            rig.exec("node4", f"umount {shared}", check=False)
    # The drain carries the health check's prefix, so the periodic health check resumes it.
    with health_checks_every(cluster, HEALTH_INTERVAL_S):
        wait_for(
            lambda: node_state(cluster, "node4")[0] == "idle",
            4 * HEALTH_INTERVAL_S + 30,
            "node4 resumed by its health check",
        )


def job_gone(cluster: Cluster, job: str) -> bool:
    """Slurm no longer holds the job: it ended and its epilog finished (COMPLETING until then)."""
    return not cluster.rig.exec(
        "node1", f"squeue --noheader --jobs {job} --format=%T"
    ).stdout.strip()


def test_the_epilog_cleans_up_after_a_user_once_their_last_job_on_the_node_ends(
    cluster: Cluster,
) -> None:
    """A process of the job's user started outside any job (Slurm's proctrack cannot see it) and
    a file of that user in /dev/shm: the epilog leaves both while another job of the user runs on
    the node, and removes both when that last job ends; another user's process stays."""
    assert cluster.first.rc == 0
    rig, uid = cluster.rig, 3001
    for host in rig.hosts:
        rig.exec(host, f"id rlmjob >/dev/null 2>&1 || useradd --uid {uid} --no-create-home rlmjob")
    # The site enforces associations: the user gets one, as a site's admin would give it.
    rig.exec("node1", f"sacctmgr -i add user rlmjob account={ACCOUNT} >/dev/null || true")
    quiet = "</dev/null >/dev/null 2>&1 &"
    rig.exec(
        "node3",
        f"runuser -u rlmjob -- setsid sleep 6061 {quiet} "
        f"runuser -u nobody -- setsid sleep 6062 {quiet} "
        "runuser -u rlmjob -- touch /dev/shm/rlm-epilog-stray && touch /dev/shm/rlm-epilog-root",
    )

    def alive(pattern: str) -> bool:
        return bool(rig.exec("node3", f"pgrep -f '{pattern}' || true").stdout.strip())

    def exists(path: str) -> bool:
        return rig.exec("node3", f"test -e {path}", check=False).returncode == 0

    wait_for(lambda: alive("[s]leep 6061") and alive("[s]leep 6062"), 30, "the stray processes")
    submit = (
        "runuser -u rlmjob -- sbatch --parsable --nodelist=node3 --mem=100M --chdir=/tmp "
        "--output=/dev/null --wrap"
    )
    holder = rig.exec("node1", f"{submit} 'sleep 300'").stdout.strip()
    try:
        wait_for(lambda: job_state(cluster, holder) == "RUNNING", 60, f"job {holder} running")
        short = rig.exec("node1", f"{submit} true").stdout.strip()
        wait_for(lambda: job_gone(cluster, short), 60, f"job {short} and its epilog to end")
        assert alive("[s]leep 6061") and exists("/dev/shm/rlm-epilog-stray")
    finally:
        rig.exec("node1", f"scancel {holder}")
    wait_for(lambda: job_gone(cluster, holder), 120, f"job {holder} and its epilog to end")
    assert not alive("[s]leep 6061")
    assert not exists("/dev/shm/rlm-epilog-stray")
    assert alive("[s]leep 6062") and exists("/dev/shm/rlm-epilog-root")
    journal = rig.exec("node3", "journalctl -t rlm-slurm-epilog --no-pager").stdout
    assert f"job {short}: uid {uid} still has job {holder} here" in journal, journal
    assert f"job {holder}: removed /dev/shm/rlm-epilog-stray" in journal, journal
    rig.exec("node3", "pkill -f '[s]leep 6062'; rm -f /dev/shm/rlm-epilog-root", check=False)


def compute_nodes_idle(cluster: Cluster) -> bool:
    out = cluster.rig.exec(
        "node1", "sinfo --noheader --Node --partition=compute --format='%N %T' || true"
    ).stdout
    return sorted(out.split("\n")[:-1]) == [f"{n} idle" for n in COMPUTE]


def test_launch_with_slurmctld_down_is_one_line_and_leaves_nothing(cluster: Cluster) -> None:
    assert cluster.first.rc == 0
    run = "slurm-no-controller"
    before = registry_rows(cluster)
    cluster.rig.exec("node1", "systemctl stop slurmctld")
    try:
        argv = ["launch", "--config", CONFIG, "--name", run, "--nodes", "2", *TINY]
        result = rlmctl("-i", str(cluster.inventory), *argv, timeout=240)
    finally:
        cluster.rig.exec("node1", "systemctl start slurmctld")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "Unable to contact slurm controller" in lines[0], lines[0]
    assert "systemctl start slurmctld" in lines[0], lines[0]
    assert not (cluster.rig.shared_dir / "runs" / run).exists()
    assert registry_rows(cluster) == before
    wait_for(lambda: compute_nodes_idle(cluster), 120, "the compute nodes idle again")

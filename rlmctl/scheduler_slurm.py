"""rlmctl's Slurm backend (`rlm_scheduler: slurm`): launch, status, stop and resume through Slurm.

Slurm allocates the nodes, starts one torchrun per node (the batch script of rlmctl.slurm), signals
and requeues; rlmctl only submits, asks `squeue`/`sacct` and reads the run directory. Slurm's
commands run on the submit host: the first host of the `mgmt` group (the controller, which has
the Slurm client and munge), over the same SSH as everything else. The run directory and the
registry are made as for an SSH launch; a submission Slurm refuses removes both again, so bad
input leaves nothing behind.
"""

from __future__ import annotations

import base64
import contextlib
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterspec.inventory import Host, Inventory
from rlmctl import slurm as batch_script
from rlmctl.errors import RlmctlError
from rlmctl.health import CRIT, OK, UNKNOWN, WARN, Check, Report
from rlmctl.records import HostStop, Launched, RunStatus, StopResult
from rlmctl.registry import Registry
from rlmctl.remote import Fleet, Result
from rlmctl.scheduler import LaunchRequest, Say, Site
from runcontract.rundir import RunDir, read_json, write_json_atomic
from runcontract.states import RunState

if TYPE_CHECKING:
    from rlmctl.supervise import WatchPolicy

SUBMIT_GROUP = "mgmt"
JOB_FILE = "slurm.json"  # in the run directory: the job id(s) of the run
# sacct states after which a job will not run again.
ENDED = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
    }
)


class SlurmRefused(RlmctlError):
    """Slurm said no (unknown partition, too many nodes, controller down): exit 1."""

    exit_code = 1


@dataclass
class Job:
    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, CANCELLED, ... ("" when Slurm does not know it)
    exit_code: str = ""
    nodes: str = ""
    reason: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ENDED


def submit_host(inventory: Inventory) -> Host:
    names = inventory.groups.get(SUBMIT_GROUP) or []
    if not names:
        raise RlmctlError(
            f"rlm_scheduler is slurm but {inventory.source} has no '{SUBMIT_GROUP}' group: add the "
            "Slurm controller (where sbatch runs) to it"
        )
    return inventory.hosts[names[0]]


def _slurm_detail(result: Result) -> str:
    """The last line a Slurm command wrote to stderr, without its `<command>: error: `."""
    lines = [line.strip() for line in (result.stderr or "").splitlines() if line.strip()]
    detail = lines[-1] if lines else result.reason
    for prefix in ("sbatch: error: ", "squeue: error: ", "scancel: error: ", "sacct: error: "):
        detail = detail.removeprefix(prefix)
    return detail.removeprefix("allocation failure: ")  # sbatch --test-only's prefix


def _slurm_error(result: Result, what: str) -> SlurmRefused:
    detail = _slurm_detail(result)
    hint = {
        "Unable to contact slurm controller": "start slurmctld on the controller "
        "(systemctl start slurmctld) or check SlurmctldHost in slurm.conf",
        "invalid partition": "pick a partition `sinfo` lists (--partition)",
        "Requested node configuration is not available": "ask for fewer --nodes than the "
        "partition has (sinfo) or another --partition",
        "Node count specification invalid": "ask for fewer --nodes than the partition has",
        # What sbatch, squeue and sinfo say on a host whose munge key differs from the
        # controller's (seen on the rig: node4 with a new key, Slurm 22.05.8): slurmctld drops
        # the request ("Protocol authentication error" in its log), the client reads nothing.
        "Zero Bytes were transmitted or received": "slurmctld refused this host's munge "
        "credential (its munge key differs from the controller's): rerun site.yml --tags slurm",
    }
    fix = next((text for key, text in hint.items() if key.lower() in detail.lower()), None)
    return SlurmRefused(f"{what}: {detail}" + (f"; {fix}" if fix else ""))


def run_slurm(fleet: Fleet, host: Host, argv: list[str], what: str) -> Result:
    result = fleet.run(shlex.join(argv), hosts=[host])[0]
    if not result.ok:
        raise _slurm_error(result, what)
    return result


def job_script(
    run: RunDir,
    name: str,
    nodes: int,
    partition: str | None,
    time_limit: str,
    exclude: list[str],
    host: Host,
    resume_from: str | None = None,
) -> str:
    return batch_script.render(
        config=run.config_path,
        name=name,
        nodes=nodes,
        gpus_per_node=host.gpus_per_node,
        partition=partition,
        time_limit=time_limit,
        host=host,
        run_dir=str(run.path),
        exclude=exclude,
        resume_from=resume_from,
    )


def check_request(
    fleet: Fleet, inventory: Inventory, script: str, partition: str | None = None
) -> None:
    """`sbatch --test-only`: Slurm judges partition, node count and credentials before anything
    is written (the script travels on stdin; no job is created). When the partition has nodes
    enough but not enough of them up, the refusal names the nodes that are out and why."""
    payload = base64.b64encode(script.encode()).decode()
    command = f"echo {payload} | base64 -d | sbatch --test-only"
    result = fleet.run(command, hosts=[submit_host(inventory)])[0]
    if result.ok:
        return
    detail = _slurm_detail(result)
    if UNAVAILABLE.lower() in detail.lower() and (
        out := unavailable_nodes(fleet, inventory, partition)
    ):
        raise SlurmRefused(f"Slurm refused the job: {detail}: {out}")
    raise _slurm_error(result, "Slurm refused the job")


UNAVAILABLE = "Requested node configuration is not available"


def unavailable_nodes(fleet: Fleet, inventory: Inventory, partition: str | None) -> str:
    """The partition's nodes Slurm will not allocate (down, drained, failing), each with its
    reason and, for a node that is down because its munge key differs, the fix; "" if none."""
    argv = ["sinfo", "--noheader", "--Node", "--format=%N|%T|%E|%P"]
    argv += [f"--partition={partition}"] if partition else []
    rows = run_slurm(fleet, submit_host(inventory), argv, "sinfo failed").stdout.splitlines()
    out = {}
    for row in rows:
        name, state, reason, part = ([*row.strip().split("|"), "", "", ""])[:4]
        if not partition and not part.endswith("*"):
            continue  # a job without --partition goes to the default one (sinfo marks it *)
        if state.rstrip("*~#!%$@^-+").startswith(("down", "drain", "fail")):
            out[name] = f"{name} is {state} ({reason})"
    if not out:
        return ""
    keys = munge_mismatches(fleet, inventory, sorted(out))
    parts = [out[name] + (f", {keys[name]}" if name in keys else "") for name in sorted(out)]
    if keys:
        fix = munge_fix(sorted(keys))
    else:
        fix = "ask for fewer --nodes, or fix them and `scontrol update NodeName=... State=RESUME`"
    return f"{'; '.join(parts)}; {fix}"


def munge_mismatches(fleet: Fleet, inventory: Inventory, names: list[str]) -> dict[str, str]:
    """Of the nodes `names`, those whose munge cannot decode a credential made on the submit
    host, i.e. whose munge key differs from the controller's; per node, what its `unmunge` said.

    Slurm itself never names the key. Seen on the rig (Slurm 22.05.8, node4 given a new key and
    its munge restarted): node4's slurmd.log says "Munge decode failed: Invalid credential" and
    "REQUEST_PING has authentication error", slurmctld.log only "[node4]:6818 failed: Zero
    Bytes were transmitted or received", then "Nodes node4 not responding, setting DOWN"; sinfo
    shows `idle*`, then `down*` with Reason "Not responding" after SlurmdTimeout; `unmunge` on
    node4 of the controller's credential: "unmunge: Error: Invalid credential", exit 14."""
    hosts = [inventory.hosts[n] for n in names if n in inventory.hosts]
    if not hosts:
        return {}
    made = fleet.run("munge --no-input", hosts=[submit_host(inventory)])[0]
    if not made.ok:
        return {}
    credential = shlex.quote(made.stdout.strip())
    decoded = fleet.run(f"echo {credential} | unmunge --no-output", hosts=hosts)
    return {
        r.host: f"its munge key differs from the controller's (unmunge: {_last_line(r)})"
        for r in decoded
        if not r.ok and r.rc is not None  # an unreachable node is not a key problem
    }


def munge_fix(nodes: list[str]) -> str:
    names = ",".join(nodes)
    return (
        "redistribute the munge key: rerun site.yml --tags slurm (Slurm returns the node to "
        f"service once it answers; if it stays down: scontrol update NodeName={names} State=RESUME)"
    )


def _last_line(result: Result) -> str:
    lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
    return (lines[-1] if lines else result.reason).removeprefix("unmunge: ")


def submit(
    fleet: Fleet,
    inventory: Inventory,
    registry: Registry,
    name: str,
    run: RunDir,
    script: str,
    kind: str,
    request: dict[str, Any],
) -> str:
    """Write the batch script into the run directory, sbatch it, record the job and what it
    asked for (nodes, partition, time limit: a resume asks for the same); its id."""
    path = run.path / f"slurm-{kind}-{len(registry.launches(name)) + 1}.sh"
    path.write_text(script, encoding="utf-8")
    path.chmod(0o755)
    result = run_slurm(
        fleet, submit_host(inventory), ["sbatch", "--parsable", str(path)], "sbatch refused the job"
    )
    job_id = result.stdout.strip().splitlines()[-1].split(";")[0]
    jobs = (read_json(run.path / JOB_FILE) or {}).get("jobs", [])
    write_json_atomic(
        run.path / JOB_FILE, {"job_id": job_id, "jobs": [*jobs, job_id], "request": request}
    )
    registry.record_launch(name, kind, [], job_id, "")
    run.record("launched", launch=kind, scheduler="slurm", job_id=job_id)
    return job_id


def launch(
    fleet: Fleet,
    inventory: Inventory,
    hosts: list[Host],
    config_file: Path,
    name: str | None,
    nodes: int | None,
    overrides: list[str],
    partition: str | None = None,
    time_limit: str = "24:00:00",
) -> tuple[str, RunDir, str]:
    """Validate, create the run directory and registry entry, submit; what Slurm refuses
    leaves neither behind. No health gate here: Slurm's HealthCheckProgram keeps unhealthy
    nodes out of the allocation."""
    from rlmctl import launch as launching

    name = launching.run_name(config_file, name)
    host = hosts[0]
    count = nodes or len(hosts)
    if count < 1:
        raise RlmctlError(f"--nodes {count}: ask for at least one node")
    run = RunDir(launching.runs_root(hosts) / name)
    text = launching.resolve_config(config_file, overrides, run.path, count * host.gpus_per_node)
    script = job_script(run, name, count, partition, time_limit, [], host)
    # Before the registry or run directory is touched.
    check_request(fleet, inventory, script, partition)
    registry = launching.open_registry(hosts)
    launching.refuse_existing(run, registry, name)
    launching.claim_run(run, registry, inventory, text, name)
    try:
        request = {"nodes": count, "partition": partition, "time_limit": time_limit}
        job_id = submit(fleet, inventory, registry, name, run, script, "launch", request)
    except BaseException:
        registry.remove_run(name)
        run.discard()
        raise
    return name, run, job_id


def job_id_of(run: RunDir) -> str | None:
    record = read_json(run.path / JOB_FILE)
    return str(record["job_id"]) if isinstance(record, dict) and record.get("job_id") else None


def job(fleet: Fleet, inventory: Inventory, job_id: str) -> Job:
    """squeue while Slurm holds the job (pending, running, requeued), else sacct."""
    host = submit_host(inventory)
    queued = run_slurm(
        fleet,
        host,
        ["squeue", "--noheader", "--jobs", job_id, "--format=%T|%N|%r"],
        "squeue failed",
    ).stdout.strip()
    if queued:
        state, nodes, reason = ([*queued.splitlines()[0].split("|"), "", ""])[:3]
        return Job(job_id, state, nodes=nodes, reason=reason)
    rows = run_slurm(
        fleet,
        host,
        [
            "sacct",
            "--noheader",
            "--parsable2",
            "--allocations",
            "--jobs",
            job_id,
            "--format=State,ExitCode,NodeList",
        ],
        "sacct failed",
    ).stdout.splitlines()
    if not rows:
        return Job(job_id, "")
    state, code, nodes = ([*rows[-1].split("|"), "", ""])[:3]
    return Job(job_id, state.split()[0], exit_code=code, nodes=nodes)


def stop(fleet: Fleet, inventory: Inventory, run: RunDir, timeout: float) -> Job:
    """SIGTERM to every task of the job's steps (the trainer checkpoints and exits 0; the batch
    script sees the recorded request and cancels its job), wait, then cancel whatever is left.

    Not `--full`: that signals the batch step too, whose srun answers SIGTERM by terminating
    the training step (SIGKILL after KillWait) before the trainer can checkpoint (seen on the
    rig with Slurm 22.05)."""
    job_id = job_id_of(run)
    if job_id is None:
        raise RlmctlError(f"run {run.name} has no Slurm job recorded ({run.path / JOB_FILE})")
    current = job(fleet, inventory, job_id)
    if current.ended:
        return current
    run.record("stop_requested", timeout_s=timeout, job_id=job_id)
    host = submit_host(inventory)
    if current.state == "RUNNING":
        run_slurm(
            fleet,
            host,
            ["scancel", "--signal=TERM", job_id],
            "scancel failed",
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = run.state()
            if state is not None and not state.active:
                break
            time.sleep(1)
    run_slurm(fleet, host, ["scancel", job_id], "scancel failed")
    deadline = time.monotonic() + 60
    current = job(fleet, inventory, job_id)
    while not current.ended and time.monotonic() < deadline:
        time.sleep(1)
        current = job(fleet, inventory, job_id)
    with contextlib.suppress(Exception):
        run.record("stopped", job_id=job_id)
    return current


def resume(
    fleet: Fleet,
    inventory: Inventory,
    hosts: list[Host],
    registry: Registry,
    name: str,
    exclude: list[str],
    say: Say,
) -> str:
    """Resubmit a stopped or failed run into its own run directory from its newest verified
    checkpoint, with the nodes, partition and time limit it was launched with (the same global
    batch), leaving out `exclude`; the new job's id. Refused while Slurm still holds its job."""
    from rlmctl import launch as launching
    from rlmctl import supervise

    run = run_dir_of(registry, name)
    supervise.refuse_done(run, name)
    record = read_json(run.path / JOB_FILE) or {}
    job_id = job_id_of(run)
    if job_id is None or "request" not in record:
        raise RlmctlError(
            f"run {name} has no Slurm job recorded in {run.path / JOB_FILE}; it was not launched "
            "under rlm_scheduler: slurm (use the inventory it was launched with)"
        )
    current = job(fleet, inventory, job_id)
    if not current.ended and current.state:
        raise RlmctlError(
            f"run {name}'s Slurm job {job_id} is {current.state}; stop it first: rlmctl stop {name}"
        )
    request = record["request"]
    host = hosts[0]
    # Same global batch: the trainer's own check says whether it divides over these workers.
    launching.resolve_config(run.config_path, [], run.path, request["nodes"] * host.gpus_per_node)
    resume_from = supervise.resume_from(run, name, say)
    script = job_script(
        run,
        name,
        request["nodes"],
        request["partition"],
        request["time_limit"],
        exclude,
        host,
        resume_from=resume_from,
    )
    check_request(fleet, inventory, script, request["partition"])
    return submit(fleet, inventory, registry, name, run, script, "resume", request)


def run_dir_of(registry: Registry, name: str) -> RunDir:
    return RunDir(Path(registry.run(name)["run_dir"]))


def status(fleet: Fleet, inventory: Inventory, registry: Registry, name: str) -> RunStatus:
    """The run directory's state of record next to what Slurm says of the run's job."""
    from rlmctl.launch import progress_fields

    run = run_dir_of(registry, name)
    job_id = job_id_of(run)
    current = job(fleet, inventory, job_id) if job_id else Job("", "")
    state = run.state()
    problem = None
    if state is not None and state.active and (current.ended or not current.state):
        problem = (
            f"recorded {state.value} but Slurm job {job_id} is {current.state or 'unknown'}; "
            f"see `rlmctl logs {name}`, then `rlmctl resume {name}`"
        )
    elif state is not None and not state.active and current.state == "RUNNING":
        problem = f"recorded {state.value} but Slurm job {job_id} is still RUNNING"
    return RunStatus(
        run=name,
        state=state,
        run_dir=str(run.path),
        hosts=[],
        problem=problem,
        **progress_fields(run),
        slurm=_job_fields(current),
    )


def node_checks(fleet: Fleet, inventory: Inventory, report: Report) -> None:
    """`rlmctl health` under Slurm: each node's `sinfo` state as a `slurm` check next to the host
    checks. Drained or draining is WARN with Slurm's reason (jobs avoid it; the health check or an
    operator put it there), down is CRIT (with the munge fix where the node's key differs from
    the controller's), idle/allocated/mixed OK."""
    try:
        out = run_slurm(
            fleet,
            submit_host(inventory),
            ["sinfo", "--noheader", "--Node", "--format=%N|%T|%E"],
            "sinfo failed",
        ).stdout
    except SlurmRefused as error:
        for host in report.hosts:
            host.checks.append(Check("slurm", UNKNOWN, str(error)))
        return
    nodes = {}
    for row in out.splitlines():
        name, state, reason = ([*row.strip().split("|"), "", ""])[:3]
        nodes[name] = (state, reason)
    # Down, or not answering yet (`*`: before SlurmdTimeout sets it down).
    silent = [
        h.host
        for h in report.hosts
        if (state := nodes.get(h.host, ("",))[0]).startswith("down") or state.endswith("*")
    ]
    keys = munge_mismatches(fleet, inventory, silent) if silent else {}
    for host in report.hosts:
        if host.host not in nodes:
            continue  # not a Slurm node (the controller)
        state, reason = nodes[host.host]
        detail = state + (f": {reason}" if reason and reason != "none" else "")
        fix = f"fix it, then: scontrol update NodeName={host.host} State=RESUME"
        base = state.rstrip("*~#!%$@^-+")
        if host.host in keys:
            host.checks.append(
                Check("slurm", CRIT, f"{detail}; {keys[host.host]}", munge_fix([host.host]))
            )
        elif base.startswith("down"):
            host.checks.append(Check("slurm", CRIT, detail, fix))
        elif base.startswith("drain"):
            host.checks.append(Check("slurm", WARN, detail, fix))
        else:
            host.checks.append(Check("slurm", OK, detail))


# watch --------------------------------------------------------------------------------------------
def failed_nodes(fleet: Fleet, inventory: Inventory, run: RunDir, ended: Job) -> list[str]:
    """The nodes a failed job must not get again, from each node's exit record
    (hosts/<node>/exit.json, written by the batch script's node wrapper when its torchrun ends):
    the node whose trainer ended first with a non-zero code before anyone signalled it (the
    others were brought down after it: `srun --kill-on-bad-exit`, or a collective with the dead
    peer); failing that, the job's nodes with no record (the wrapper itself was lost with its
    node); and the job's nodes that Slurm now has drained or down."""
    nodes = job_nodes(fleet, inventory, ended)
    records = exit_records(run, ended.job_id, nodes)
    first = sorted(
        (float(r["time"]), node)
        for node, r in records.items()
        if r["exit_code"] != 0 and r.get("signalled") is not True
    )
    bad = {first[0][1]} if first else {n for n in nodes if n not in records}
    if nodes:
        states = run_slurm(
            fleet,
            submit_host(inventory),
            ["sinfo", "--noheader", "--Node", f"--nodes={','.join(nodes)}", "--format=%N|%T"],
            "sinfo failed",
        ).stdout
        for row in states.splitlines():
            node, _, state = row.strip().partition("|")
            if state.startswith(("drain", "down", "fail")):
                bad.add(node)
    return sorted(bad)


def job_nodes(fleet: Fleet, inventory: Inventory, ended: Job) -> list[str]:
    """The node names of the job's allocation (Slurm's compressed `node[2-3]` expanded)."""
    if not ended.nodes or ended.nodes in ("None assigned", "(null)"):
        return []
    return run_slurm(
        fleet,
        submit_host(inventory),
        ["scontrol", "show", "hostnames", ended.nodes],
        "scontrol failed",
    ).stdout.split()


def exit_records(run: RunDir, job_id: str, nodes: list[str]) -> dict[str, dict[str, Any]]:
    """Each node's exit record of job `job_id`."""
    records = {}
    for node in nodes:
        record = read_json(run.exit_record_path(node))
        if (
            isinstance(record, dict)
            and str(record.get("job_id")) == job_id
            and isinstance(record.get("exit_code"), int)
            and isinstance(record.get("time"), int | float)
        ):
            records[node] = record
    return records


def _stop_requested_since(run: RunDir, since: float) -> bool:
    return any(e.kind == "stop_requested" and e.time >= since for e in run.events())


def follow(
    fleet: Fleet,
    inventory: Inventory,
    run: RunDir,
    job_id: str,
    since: float,
    policy: WatchPolicy,
    say: Say,
) -> tuple[Job | None, str | None]:
    """Poll the job until Slurm ends it: (the ended job, None), or (None, why) when the run was
    stopped (rlmctl stop). A running job without a new step for `policy.stall_s` is cancelled
    and returned as ended."""
    last_step, last_change = None, time.monotonic()
    while True:
        current = job(fleet, inventory, job_id)
        if _stop_requested_since(run, since):
            return None, f"run {run.name} was stopped (rlmctl stop)"
        if current.ended or not current.state:
            return current, None
        step = run.status().step
        if step != last_step or current.state != "RUNNING":  # pending/requeued: no clock
            if step != last_step and last_step is not None:
                say(f"step {step} loss {run.status().loss}")
            last_step, last_change = step, time.monotonic()
        elif time.monotonic() - last_change > policy.stall_s:
            run_slurm(fleet, submit_host(inventory), ["scancel", job_id], "scancel failed")
            return Job(job_id, "CANCELLED", reason="hang"), None
        time.sleep(policy.poll_s)  # the supervisor's polling interval, not a synchronisation


def watch(
    fleet: Fleet,
    inventory: Inventory,
    hosts: list[Host],
    registry: Registry,
    name: str,
    policy: WatchPolicy,
    say: Say,
) -> int:
    """`rlmctl watch` under Slurm: follow the run's job; when it ends without the run done,
    decide from the trainer's exit code, and resubmit (`resume`) from the newest verified
    checkpoint with every node that failed a job of the run excluded, within the restart budget.
    Requeues (time limit, preemption) are Slurm's: the same job comes back, watch keeps
    following it. Every decision is an event in the run directory (failure, excluded, gave_up)."""
    from rlmctl import launch as launching

    run = run_dir_of(registry, name)
    restarts = 0
    excluded = {h for e in run.events() if e.kind == "excluded" for h in e.fields.get("hosts", [])}
    while True:
        job_id = job_id_of(run)
        if job_id is None:
            raise RlmctlError(f"run {name} has no Slurm job recorded ({run.path / JOB_FILE})")
        since = registry.launches(name)[-1]["time"]
        say(f"following Slurm job {job_id} of run {name}")
        ended, stopped = follow(fleet, inventory, run, job_id, since, policy, say)
        if stopped:
            say(stopped)
            return 0
        if run.state() is RunState.DONE:
            say(f"run {name} done at step {run.status().step}")
            return 0
        code = launching.exit_code(run, job_nodes(fleet, inventory, ended), since)
        bad = failed_nodes(fleet, inventory, run, ended)
        where = f" (failed on {', '.join(bad)})" if bad else ""
        failure = f"Slurm job {job_id} ended {ended.state or 'unknown'} {ended.exit_code}{where}"
        run.append_event(
            "failure",
            reason=failure,
            exit_code=code,
            step=run.status().step,
            job_id=job_id,
            nodes=bad,
        )
        say(f"failure: {failure}")
        if not launching.restartable(code):
            return _give_up(
                run, f"exit code {code} is not restartable (see rlmctl logs {name})", say
            )
        if restarts >= policy.max_restarts:
            return _give_up(run, f"restart budget of {policy.max_restarts} used up", say)
        new = sorted(set(bad) - excluded)
        if new:
            excluded |= set(new)
            run.append_event("excluded", hosts=new, reason=f"failed in Slurm job {job_id}")
        delay = policy.backoff_s * 2**restarts
        restarts += 1
        say(f"restart {restarts}/{policy.max_restarts} in {delay:g} s (exit code {code})")
        time.sleep(delay)  # back-off policy: give a flapping node or filesystem time to recover
        try:
            new_job = resume(fleet, inventory, hosts, registry, name, sorted(excluded), say)
        except RlmctlError as error:  # every node excluded, batch no longer divides, ...
            return _give_up(run, str(error), say)
        say(f"resubmitted as Slurm job {new_job}, excluding {', '.join(sorted(excluded)) or '-'}")


def _give_up(run: RunDir, message: str, say: Say) -> int:
    run.record("gave_up", reason=message)
    say(f"giving up: {message}")
    return 1


# the scheduler interface --------------------------------------------------------------------------
class SlurmScheduler:
    """rlmctl.scheduler.Scheduler for `rlm_scheduler: slurm`: every Slurm command runs on the
    submit host; Slurm allocates, starts, signals and accounts the job."""

    def __init__(self, site: Site) -> None:
        self.site = site

    def launch(self, request: LaunchRequest, say: Say) -> Launched:
        site = self.site
        with site.fleet([]) as fleet:
            name, run, job_id = launch(
                fleet,
                site.inventory(),
                site.hosts(),
                request.config,
                request.name,
                request.nodes,
                request.overrides,
                request.partition,
                request.time_limit,
            )
        return Launched(name, str(run.path), [], "", job_id=job_id)

    def status(self, run: str) -> RunStatus:
        with self.site.registry(readonly=True) as registry, self.site.fleet([]) as fleet:
            return status(fleet, self.site.inventory(), registry, run)

    def stop(self, run: str, timeout: float) -> StopResult:
        with self.site.registry() as registry, self.site.fleet([]) as fleet:
            run_dir = run_dir_of(registry, run)
            ended = stop(fleet, self.site.inventory(), run_dir, timeout)
        outcome = HostStop(
            ended.nodes or "-",
            ok=ended.ended,
            error=None if ended.ended else f"Slurm job {ended.job_id} is still {ended.state}",
        )
        return StopResult(run, run_dir.state(), [outcome], slurm=_job_fields(ended))

    def resume(self, run: str, exclude: set[str], force: bool, say: Say) -> Launched:
        """`force` has no meaning here: Slurm's health check decides which nodes take jobs."""
        site = self.site
        with site.registry() as registry, site.fleet([]) as fleet:
            job_id = resume(
                fleet, site.inventory(), site.hosts(), registry, run, sorted(exclude), say
            )
            run_dir = run_dir_of(registry, run)
        return Launched(run, str(run_dir.path), [], "", kind="resume", job_id=job_id)

    def watch(self, run: str, policy: WatchPolicy, say: Say) -> int:
        site = self.site
        with site.registry() as registry, site.fleet([]) as fleet:
            return watch(fleet, site.inventory(), site.hosts(), registry, run, policy, say)

    def node_checks(self, fleet: Fleet, report: Report) -> None:
        node_checks(fleet, self.site.inventory(), report)


def _job_fields(current: Job) -> dict[str, str]:
    return {
        "job_id": current.job_id,
        "state": current.state,
        "exit_code": current.exit_code,
        "nodes": current.nodes,
        "reason": current.reason,
    }

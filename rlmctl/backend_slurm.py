"""The Slurm backend (`rlm_scheduler: slurm`): an attempt is a batch job.

Slurm allocates the nodes, starts one torchrun per node (the batch script of rlmctl.slurm), signals
and requeues; rlmctl only submits, asks `squeue`/`sacct` and reads the run directory. Slurm's
commands run on the submit host: the first host of the `mgmt` group (the controller, which has
the Slurm client and munge), over the same SSH as everything else but logged in as the site's
service account (`rlm_service_user`), never as root: a job runs as whoever submitted it, on every
node. The run directory is handed to that user before a job is submitted. `sbatch --test-only`
judges a job before anything is written, so what Slurm refuses leaves nothing behind.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import pwd
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterspec.inventory import Host
from rlmctl import slurm as batch_script
from rlmctl.backend import Attempt, LaunchRequest, Placement, Probe, Say, Started
from rlmctl.context import Context
from rlmctl.errors import RlmctlError
from rlmctl.health import CRIT, OK, UNKNOWN, WARN, Check, Report
from rlmctl.records import HostProcesses, HostStop
from rlmctl.remote import Result
from runcontract.rundir import RunDir, read_json, write_json_atomic
from runcontract.states import EventKind

SUBMIT_GROUP = "mgmt"
JOB_FILE = "slurm.json"  # in the run directory: the job id(s) of the run, what it asked for
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
# `sinfo %T` states of a node that takes jobs. A flag after it (`*` not responding, `~` powered
# off, `#`/`%` powering up/down, `@`/`^` reboot, `$` maintenance, `+` more states) means not yet;
# `-` (planned by the backfill scheduler) is in service.
IN_SERVICE = frozenset({"idle", "mixed", "allocated", "completing", "planned"})
OUT = ("drain", "down", "fail")  # states (prefixes) of a node that jobs must avoid
UNAVAILABLE = "Requested node configuration is not available"
# What sbatch --test-only says when a job asks for more nodes than it can get, whether the
# partition is too small or some of its nodes are out: the node count is not in the message.
NODE_COUNT_REFUSALS = (UNAVAILABLE, "Node count specification invalid")


def give(path: Path, uid: int, gid: int) -> bool:
    """lchown `path` to uid:gid unless it is theirs already; whether it was."""
    owned = path.lstat()
    if (owned.st_uid, owned.st_gid) == (uid, gid):
        return True
    os.lchown(path, uid, gid)
    return False


def give_run_directory(run: RunDir, uid: int, gid: int) -> None:
    """The run directory and what is in it to uid:gid, but for the inside of a checkpoint that
    is theirs already: the jobs write each checkpoint whole as that user and rlmctl never writes
    into one, and checkpoints hold nearly all of a big run's files (a shard per rank and save),
    on a parallel filesystem where every stat is a round trip to its metadata server. One that
    is not theirs (made by root: `rlm-train import-hf`, a copy) is walked and handed over."""
    give(run.path, uid, gid)
    for directory, dirnames, filenames in os.walk(run.path):
        here = Path(directory)
        for name in filenames:
            give(here / name, uid, gid)
        theirs = {name for name in dirnames if give(here / name, uid, gid)}
        if here == run.checkpoints_dir:
            dirnames[:] = [name for name in dirnames if name not in theirs]


@dataclass(frozen=True)
class NodeRow:
    """One node of a partition as `sinfo --Node` lists it."""

    name: str
    state: str  # idle, allocated, down*, drained, ...
    reason: str
    partition: str  # without sinfo's `*` for the default one


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

    def as_dict(self) -> dict[str, str]:
        return {
            "job_id": self.job_id,
            "state": self.state,
            "exit_code": self.exit_code,
            "nodes": self.nodes,
            "reason": self.reason,
        }


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
        UNAVAILABLE: "ask for fewer --nodes than the partition has (sinfo) or another --partition",
        "Node count specification invalid": "ask for fewer --nodes than the partition has",
        # AccountingStorageEnforce=associations: no account, or one the user has no
        # association with (Slurm 22.05's wording for both).
        "Invalid account": "set rlm_slurm_account (or --account) to an account of the "
        "submitting user (sacctmgr show associations user=$USER)",
        "Invalid qos": "set rlm_slurm_qos (or --qos) to a QOS the account may use "
        "(sacctmgr show associations user=$USER format=account,qos)",
        "Requested reservation is invalid": "set rlm_slurm_reservation (or --reservation) to a "
        "reservation of yours (scontrol show reservation)",
        "Invalid feature specification": "set rlm_slurm_constraint (or --constraint) to "
        "features the nodes have (sinfo --format=%N|%f)",
        # What sbatch, squeue and sinfo say on a host whose munge key differs from the
        # controller's (seen on the rig: node4 with a new key, Slurm 22.05.8): slurmctld drops
        # the request ("Protocol authentication error" in its log), the client reads nothing.
        "Zero Bytes were transmitted or received": "slurmctld refused this host's munge "
        "credential (its munge key differs from the controller's): rerun site.yml --tags slurm",
    }
    fix = next((text for key, text in hint.items() if key.lower() in detail.lower()), None)
    return SlurmRefused(f"{what}: {detail}" + (f"; {fix}" if fix else ""))


def _no_client(result: Result) -> SlurmRefused | None:
    """The submit host has no Slurm client (the shell's exit 127, "sbatch: command not found"):
    not a refusal by Slurm."""
    detail = _slurm_detail(result)
    if result.rc != 127 and "command not found" not in detail:
        return None
    command = detail.split(":")[-2].strip() if detail.count(":") >= 2 else "Slurm's commands"
    return SlurmRefused(
        f"{result.host} (the first 'mgmt' host, where rlmctl runs Slurm's commands) has no "
        f"{command}; put the Slurm controller first in the mgmt group, or install the Slurm "
        "client there (site.yml --tags slurm)"
    )


def _not_run(result: Result, user: str) -> SlurmRefused | None:
    """The command never ran on the submit host (no connection, or the service user's login was
    refused): name the user rlmctl logs in as, since a root login works where that one fails."""
    if result.rc is not None or not result.error or result.error.startswith("timed out"):
        return None
    return SlurmRefused(
        f"cannot run Slurm's commands on {result.host} as {user} (rlm_service_user, who submits "
        f"the jobs): {result.error}; site.yml --tags users_ssh creates {user} with the operators' "
        "keys"
    )


ROOT_REFUSED = (
    "rlm_service_user is root: rlmctl never submits Slurm jobs as root (a job runs as its "
    "submitter on every node); set rlm_service_user to the site's service account (users_ssh "
    "creates it, with the operators' keys)"
)


def munge_fix(nodes: list[str]) -> str:
    names = ",".join(nodes)
    return (
        "redistribute the munge key: rerun site.yml --tags slurm (Slurm returns the node to "
        f"service once it answers; if it stays down: scontrol update NodeName={names} State=RESUME)"
    )


def _last_line(result: Result) -> str:
    lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
    return (lines[-1] if lines else result.reason).removeprefix("unmunge: ")


def job_id_of(run: RunDir) -> str | None:
    record = read_json(run.path / JOB_FILE)
    return str(record["job_id"]) if isinstance(record, dict) and record.get("job_id") else None


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


class Backend:
    """rlmctl.backend.Backend through Slurm: every Slurm command runs on the submit host."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._owner: tuple[int, int] | None = None
        self._hold_refused: set[str] = set()  # jobs whose requeue hold Slurm would not lift

    # Slurm's commands -------------------------------------------------------------------------
    @property
    def submit_host(self) -> Host:
        inventory = self.ctx.inventory
        names = inventory.groups.get(SUBMIT_GROUP) or []
        if not names:
            raise RlmctlError(
                f"rlm_scheduler is slurm but {inventory.source} has no '{SUBMIT_GROUP}' group: "
                "add the Slurm controller (where sbatch runs) to it"
            )
        return inventory.hosts[names[0]]

    def submitter(self) -> Host:
        """The submit host as Slurm's commands reach it: over SSH logged in as rlm_service_user
        (users_ssh gives it the operators' keys) whatever user the inventory logs in as; on a
        local submit host (rlmctl on the controller) as whoever runs rlmctl, or, for root,
        rlm_service_user (`submit_command`). Never root."""
        host = self.submit_host
        if host.service_user == "root":
            raise RlmctlError(ROOT_REFUSED)
        if host.is_local:
            return host
        # ssh keeps the first value it reads: this User wins over the inventory's.
        login = ("-o", f"User={host.service_user}")
        return dataclasses.replace(host, user=host.service_user, ssh_args=login + host.ssh_args)

    def submit_command(self, host: Host, command: str) -> str:
        """`command` as the submitter runs it: as is over SSH (the login is the service user)
        and for a local non-root rlmctl (an operator submits as themselves); through runuser
        for a local root."""
        if not host.is_local or os.geteuid() != 0:
            return command
        user = host.service_user
        try:
            pwd.getpwnam(user)
        except KeyError:
            raise RlmctlError(
                f"rlm_service_user {user} does not exist on {host.name}, where rlmctl (run as "
                f"root) submits Slurm jobs as {user}: create it (site.yml --tags users_ssh) or "
                "set rlm_service_user to an existing non-root user"
            ) from None
        runuser = shutil.which("runuser", path="/usr/sbin:/sbin:/usr/bin:/bin") or "runuser"
        return shlex.join([runuser, "-u", user, "--", "/bin/sh", "-c", command])

    def on_submit_host(self, command: str) -> Result:
        host = self.submitter()
        return self.ctx.fleet.run(self.submit_command(host, command), hosts=[host])[0]

    def slurm(self, argv: list[str], what: str) -> Result:
        result = self.on_submit_host(shlex.join(argv))
        if not result.ok:
            user = self.submit_host.service_user
            raise _not_run(result, user) or _no_client(result) or _slurm_error(result, what)
        return result

    def job_owner(self) -> tuple[int, int]:
        """The uid and gid the jobs run as (the submitter's, asked on the submit host: the
        service user need not exist where rlmctl runs), checked against who runs rlmctl: the
        run directory must be theirs, and only root can give it away."""
        if self._owner is None:
            ids = self.slurm(["sh", "-c", "id -u; id -g"], "id failed").stdout.split()
            uid, gid = int(ids[0]), int(ids[1])
            if os.geteuid() not in (0, uid):
                user = self.submit_host.service_user
                raise RlmctlError(
                    f"Slurm jobs run as {user} (uid {uid}, rlm_service_user) but rlmctl runs as "
                    f"uid {os.geteuid()} and cannot give {user} the run directory: run rlmctl "
                    f"as {user} or as root"
                )
            self._owner = (uid, gid)
        return self._owner

    def hand_over(self, run: RunDir, paths: list[Path] | None = None) -> None:
        """The run directory and everything in it (or just `paths`) to the jobs' user, who
        writes there (status, events, checkpoints, the job's output). What rlmctl appends to
        later (events) keeps its owner; what it replaces (slurm.json) is handed over again."""
        uid, gid = self.job_owner()
        if (uid, gid) == (os.geteuid(), os.getegid()):
            return
        try:
            if paths is None:
                give_run_directory(run, uid, gid)
            for path in paths or []:
                give(path, uid, gid)
        except OSError as error:  # e.g. NFS with root_squash: root is nobody there
            user = self.submit_host.service_user
            raise RlmctlError(
                f"cannot give {user} (uid {uid}) the run directory {run.path}: {error.strerror}; "
                f"run rlmctl as {user}"
            ) from None

    def job(self, job_id: str) -> Job:
        """squeue while Slurm holds the job (pending, running, requeued), else sacct."""
        queued = self.slurm(
            ["squeue", "--noheader", "--jobs", job_id, "--format=%T|%N|%r"], "squeue failed"
        ).stdout.strip()
        if queued:
            state, nodes, reason = ([*queued.splitlines()[0].split("|"), "", ""])[:3]
            return Job(job_id, state, nodes=nodes, reason=reason)
        argv = ["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", job_id]
        rows = self.slurm([*argv, "--format=State,ExitCode,NodeList"], "sacct failed")
        lines = rows.stdout.splitlines()
        if not lines:
            return Job(job_id, "")
        state, code, nodes = ([*lines[-1].split("|"), "", ""])[:3]
        return Job(job_id, state.split()[0], exit_code=code, nodes=nodes)

    def job_nodes(self, job: Job) -> list[str]:
        """The node names of the job's allocation (Slurm's compressed `node[2-3]` expanded)."""
        if not job.nodes or job.nodes in ("None assigned", "(null)"):
            return []
        shown = self.slurm(["scontrol", "show", "hostnames", job.nodes], "scontrol failed")
        return shown.stdout.split()

    # where --------------------------------------------------------------------------------------
    def placement(self, request: LaunchRequest) -> Placement:
        """No health gate: Slurm's HealthCheckProgram keeps unhealthy nodes out."""
        hosts = self.ctx.hosts
        nodes = request.nodes or len(hosts)
        if nodes < 1:
            raise RlmctlError(f"--nodes {nodes}: ask for at least one node")
        batch_script.time_limit_seconds(request.time_limit)  # a form Slurm refuses: one line
        batch_script.SiteOptions.of(hosts[0], request.site)  # bad site options: one line
        if hosts[0].service_user == "root":  # one line before anything else (dry runs too)
            raise RlmctlError(ROOT_REFUSED)
        if request.segments < 1:
            raise RlmctlError(f"--segments {request.segments}: ask for at least one segment")
        return Placement(
            hosts=[],
            nodes=nodes,
            gpus_per_node=hosts[0].gpus_per_node,
            template=hosts[0],
            partition=request.partition,
            time_limit=request.time_limit,
            site=dict(request.site),
            segments=request.segments,
        )

    def placement_of(self, run: RunDir, exclude: set[str]) -> Placement:
        """The nodes, partition and time limit it was launched with (the same global batch)."""
        record = read_json(run.path / JOB_FILE) or {}
        if job_id_of(run) is None or "request" not in record:
            raise RlmctlError(
                f"run {run.name} has no Slurm job recorded in {run.path / JOB_FILE}; it was not "
                "launched under rlm_scheduler: slurm (use the inventory it was launched with)"
            )
        request = record["request"]
        host = self.ctx.hosts[0]
        return Placement(
            hosts=[],
            nodes=request["nodes"],
            gpus_per_node=host.gpus_per_node,
            template=host,
            partition=request["partition"],
            time_limit=request["time_limit"],
            exclude=sorted(exclude),
            site=dict(request.get("site") or {}),
        )

    def script(self, run: RunDir, placement: Placement, attempt: Attempt, segment: int = 1) -> str:
        segments = placement.segments if attempt.kind == "launch" else 1
        return batch_script.render(
            config=run.config_path,
            name=run.name,
            nodes=placement.nodes,
            gpus_per_node=placement.gpus_per_node,
            partition=placement.partition,
            time_limit=placement.time_limit,
            host=placement.template,
            run_dir=str(run.path),
            exclude=placement.exclude,
            resume_from=attempt.resume_from,
            site=batch_script.SiteOptions.of(placement.template, placement.site),
            segment=segment,
            segments=segments,
            overrides=list(attempt.overrides),
        )

    def commands(self, run: RunDir, placement: Placement, attempt: Attempt) -> dict[str, str]:
        """What `start` submits (`--dry-run`, `rlmctl slurm`): the batch script, by name (one
        per segment of a chain, launch --segments)."""
        name = self.script_name(run, attempt, pending=True)
        segments = placement.segments if attempt.kind == "launch" else 1
        if segments == 1:
            return {name: self.script(run, placement, attempt)}
        stem = name.removesuffix(".sh")
        return {
            f"{stem}-seg{k}.sh": self.script(run, placement, attempt, k)
            for k in range(1, segments + 1)
        }

    def script_name(self, run: RunDir, attempt: Attempt, pending: bool = False) -> str:
        """slurm-<launch|resume>-<attempt number>.sh in the run directory."""
        number = len(self.ctx.registry.launches(run.name)) if run.path.exists() else 0
        return f"slurm-{attempt.kind}-{number + (1 if pending else 0)}.sh"

    def stop_commands(
        self, run: RunDir, probe: Probe, timeout: float, leave_out: set[str]
    ) -> dict[str, str]:
        """What `stop` would run on the submit host (`--dry-run`)."""
        if job_id_of(run) is None:
            raise RlmctlError(f"run {run.name} has no Slurm job recorded ({run.path / JOB_FILE})")
        current = self.current(run)
        job_id = current.job_id
        if current.ended:
            return {
                self.submit_host.name: f"# Slurm job {job_id} is {current.state}: nothing to do"
            }
        chain = (read_json(run.path / JOB_FILE) or {}).get("chain")
        pending = f"scancel --state=PENDING --name={run.name}; " if chain else ""
        term = f"scancel --signal=TERM {job_id}; " if current.state == "RUNNING" else ""
        wait = f"wait up to {timeout:g} s for the trainer to stop; " if term else ""
        return {self.submit_host.name: f"{pending}{term}{wait}scancel {job_id}"}

    def admit(self, run: RunDir, placement: Placement, attempt: Attempt, say: Say) -> Placement:
        """`sbatch --test-only`: Slurm judges partition, node count and credentials (the script
        travels on stdin; no job is created). Slurm's refusal of a node count does not say why:
        more nodes than the partition has is said so; when it has
        nodes enough but not enough of them up, the refusal names the nodes that are out and
        why. Then who will own the run directory (`job_owner`)."""
        payload = base64.b64encode(self.script(run, placement, attempt).encode()).decode()
        result = self.on_submit_host(f"echo {payload} | base64 -d | sbatch --test-only")
        if not_run := _not_run(result, self.submit_host.service_user):
            raise not_run
        if result.ok:
            self.job_owner()  # a run directory rlmctl could not give the jobs' user: one line
            return placement
        if missing := _no_client(result):
            raise missing
        detail = _slurm_detail(result)
        if any(words.lower() in detail.lower() for words in NODE_COUNT_REFUSALS):
            rows = self.partition_nodes(placement.partition)
            if too_few := self.too_few_nodes(rows, placement):
                raise SlurmRefused(f"Slurm refused the job: {detail}: {too_few}")
            if UNAVAILABLE.lower() in detail.lower() and (out := self.unavailable_nodes(rows)):
                raise SlurmRefused(f"Slurm refused the job: {detail}: {out}")
        raise _slurm_error(result, "Slurm refused the job")

    def partition_nodes(self, partition: str | None) -> list[NodeRow]:
        """The nodes of the job's partition (the default one without --partition), as sinfo
        lists them: name, state, reason, partition."""
        argv = ["sinfo", "--noheader", "--Node", "--format=%N|%T|%E|%P"]
        argv += [f"--partition={partition}"] if partition else []
        rows = []
        for row in self.slurm(argv, "sinfo failed").stdout.splitlines():
            name, state, reason, part = ([*row.strip().split("|"), "", "", ""])[:4]
            if not name or (not partition and not part.endswith("*")):
                continue  # a job without --partition goes to the default one (sinfo marks it *)
            rows.append(NodeRow(name, state, reason, part.rstrip("*")))
        return rows

    @staticmethod
    def too_few_nodes(rows: list[NodeRow], placement: Placement) -> str:
        """What to say when the job asks for more nodes than its partition has at all, whatever
        their state: no node being down is the reason; "" if it has enough. Slurm says
        "Requested node configuration is not available" either way."""
        count = len({row.name for row in rows})  # sinfo --Node lists a node once per partition
        if not count or placement.nodes <= count:
            return ""
        return (
            f"partition {rows[0].partition} has only {count} nodes; ask for --nodes "
            f"{count} or fewer, or another --partition (sinfo --summarize)"
        )

    def unavailable_nodes(self, rows: list[NodeRow]) -> str:
        """The partition's nodes Slurm will not allocate (down, drained, failing), each with its
        reason and, for a node that is down because its munge key differs, the fix; "" if none."""
        out = {}
        for row in rows:
            if row.state.rstrip("*~#!%$@^-+").startswith(("down", "drain", "fail")):
                out[row.name] = f"{row.name} is {row.state} ({row.reason})"
        if not out:
            return ""
        keys = self.munge_mismatches(sorted(out))
        parts = [out[name] + (f", {keys[name]}" if name in keys else "") for name in sorted(out)]
        if keys:
            fix = munge_fix(sorted(keys))
        else:
            fix = (
                "ask for fewer --nodes, or fix them and `scontrol update NodeName=... State=RESUME`"
            )
        return f"{'; '.join(parts)}; {fix}"

    def munge_mismatches(self, names: list[str]) -> dict[str, str]:
        """Of the nodes `names`, those whose munge cannot decode a credential made on the submit
        host, i.e. whose munge key differs from the controller's; per node, what `unmunge` said.

        Slurm itself never names the key. Seen on the rig (Slurm 22.05.8, node4 given a new key
        and its munge restarted): node4's slurmd.log says "Munge decode failed: Invalid
        credential" and "REQUEST_PING has authentication error", slurmctld.log only
        "[node4]:6818 failed: Zero Bytes were transmitted or received", then "Nodes node4 not
        responding, setting DOWN"; sinfo shows `idle*`, then `down*` with Reason "Not
        responding" after SlurmdTimeout; `unmunge` on node4 of the controller's credential:
        "unmunge: Error: Invalid credential", exit 14."""
        hosts = [self.ctx.inventory.hosts[n] for n in names if n in self.ctx.inventory.hosts]
        if not hosts:
            return {}
        made = self.on_submit_host("munge --no-input")
        if not made.ok:
            return {}
        credential = shlex.quote(made.stdout.strip())
        decoded = self.ctx.fleet.run(f"echo {credential} | unmunge --no-output", hosts=hosts)
        return {
            r.host: f"its munge key differs from the controller's (unmunge: {_last_line(r)})"
            for r in decoded
            if not r.ok and r.rc is not None  # an unreachable node is not a key problem
        }

    # start --------------------------------------------------------------------------------------
    def start(self, run: RunDir, placement: Placement, attempt: Attempt, say: Say) -> Started:
        """Write the batch script into the run directory, sbatch it, record the job and what it
        asked for (nodes, partition, time limit: a resume asks for the same)."""
        stem = self.script_name(run, attempt).removesuffix(".sh")
        segments = placement.segments if attempt.kind == "launch" else 1
        chain: list[str] = []
        paths = []
        for segment in range(1, segments + 1):
            path = run.path / (f"{stem}.sh" if segments == 1 else f"{stem}-seg{segment}.sh")
            path.write_text(self.script(run, placement, attempt, segment), encoding="utf-8")
            path.chmod(0o755)
            paths.append(path)
        self.hand_over(run)  # the job writes there from its first second
        for path in paths:
            # A chain (launch --segments): segment k starts once k-1 has ended, whatever its end.
            after = [f"--dependency=afterany:{chain[-1]}"] if chain else []
            try:
                result = self.slurm(
                    ["sbatch", "--parsable", *after, str(path)], "sbatch refused the job"
                )
            except SlurmRefused:
                for queued in chain:  # half a chain would end early: none of it
                    self.slurm(["scancel", queued], "scancel failed")
                raise
            chain.append(result.stdout.strip().splitlines()[-1].split(";")[0])
        job_id = chain[0]
        jobs = (read_json(run.path / JOB_FILE) or {}).get("jobs", [])
        request = {
            "nodes": placement.nodes,
            "partition": placement.partition,
            "time_limit": placement.time_limit,
            "site": placement.site,  # the command line's site options: a resume keeps them
        }
        record = {"job_id": job_id, "jobs": [*jobs, *chain], "request": request}
        if len(chain) > 1:
            record["chain"] = chain
        write_json_atomic(run.path / JOB_FILE, record)
        self.hand_over(run, [run.path / JOB_FILE])
        return Started(hosts=[], rdzv_id=job_id, job_id=job_id)

    def abandon(self, run: RunDir) -> bool:
        """Cancel the attempt's job: the recorded one, and any job of the run's name (a launch
        interrupted between sbatch and its record; while an attempt is being started no other
        job of the run exists: resume refuses while Slurm holds one)."""
        job_id = job_id_of(run)
        if job_id is not None and not self.job(job_id).ended:
            self.slurm(["scancel", job_id], "scancel failed")
        self.slurm(["scancel", f"--name={run.name}"], "scancel failed")
        return True

    # look ---------------------------------------------------------------------------------------
    def current(self, run: RunDir) -> Job:
        """The run's job now: the recorded one, or in a chain (launch --segments) the first
        segment from it on that Slurm still holds, else the chain's last."""
        job_id = job_id_of(run)
        if job_id is None:
            return Job("", "")
        current = self.job(job_id)
        chain = [str(j) for j in (read_json(run.path / JOB_FILE) or {}).get("chain") or []]
        if current.ended and job_id in chain:
            for later in chain[chain.index(job_id) + 1 :]:
                current = self.job(later)
                if not current.ended:
                    break
        return current

    def probe(self, run: RunDir) -> Probe:
        current = self.current(run)
        job_id = current.job_id or None
        held = bool(current.state) and not current.ended
        # The host table of `status`: the nodes Slurm allocated to the job while it runs.
        nodes = self.job_nodes(current) if current.state in ("RUNNING", "COMPLETING") else []
        return Probe(
            alive=held,
            running=held,
            complete=held,
            executing=[current.job_id] if current.state == "RUNNING" else [],
            not_running=f"Slurm job {job_id} is {current.state or 'unknown'}",
            still_running=f"Slurm job {job_id} is still {current.state}",
            ended=f"Slurm job {job_id} ended {current.state or 'unknown'} {current.exit_code}",
            recovery=f"`rlmctl resume {run.name}`",
            hosts=[HostProcesses(node, alive=True, processes=None) for node in nodes],
            job=current.as_dict(),
            ref={"job_id": job_id} if job_id else {},
        )

    def tend(self, run: RunDir, say: Say) -> None:
        """Watch's look at the queue on every poll. A requeue Slurm made (NODE_FAIL, preemption,
        time limit, `scontrol requeue`: the job's Restarts grew) is recorded once as a
        `requeued` event with its reason (the batch script records the requeues it asks for
        itself, with the same restart number), and said. A requeued job Slurm holds until its
        old credential expires (Reason=BeginTime, cred_expire + 1 s: docs/slurm.md) is started
        at once with `scontrol update StartTime=now`, which Slurm allows once it is pending;
        after a preemption it is not, so the preempting job gets the nodes first."""
        job_id = self.current(run).job_id if job_id_of(run) else None
        if not job_id:
            return
        shown = self.on_submit_host(shlex.join(["scontrol", "--oneliner", "show", "job", job_id]))
        if not shown.ok:
            return  # gone from slurmctld's memory: sacct has it, and it will not requeue
        fields = dict(
            word.split("=", 1) for word in shown.stdout.split() if "=" in word and word[0].isupper()
        )
        restarts = int(fields.get("Restarts", "0") or 0)
        state, reason = fields.get("JobState", ""), fields.get("Reason", "")
        requeues = [
            e.fields
            for e in run.events()
            if e.kind == EventKind.REQUEUED and str(e.fields.get("job_id")) == job_id
        ]
        if restarts > 0 and not any(seen.get("restart") == restarts for seen in requeues):
            why = self.requeue_reason(job_id)
            run.append_event(
                EventKind.REQUEUED, job_id=job_id, restart=restarts, reason=why, seen_by="watch"
            )
            requeues.append({"reason": why})
            say(f"Slurm requeued job {job_id} ({why}); restart {restarts}")
        # A preempted job's hold is left to run out: the job that preempted it needs the nodes
        # first, and a job started at once is preempted again and ends FAILED (seen on the rig).
        preempted = bool(requeues) and "preempt" in str(requeues[-1].get("reason")).lower()
        if restarts > 0 and state == "PENDING" and reason == "BeginTime" and not preempted:
            if job_id in self._hold_refused:
                return  # said once; Slurm starts it when the hold ends
            try:
                self.slurm(
                    ["scontrol", "update", f"JobId={job_id}", "StartTime=now"],
                    "scontrol update failed",
                )
            except SlurmRefused as error:
                # Run as the job's owner (rlm_service_user), not an operator: a site's Slurm
                # may refuse it. Waiting out the hold costs time, not the run.
                self._hold_refused.add(job_id)
                say(f"job {job_id} stays in Slurm's requeue hold until it ends ({error})")
                return
            say(f"released job {job_id} from Slurm's requeue hold (StartTime=now)")

    def requeue_reason(self, job_id: str) -> str:
        """Why Slurm requeued the job: the state its newest earlier run ended in (sacct keeps a
        record per run of a requeued job: NODE_FAIL, PREEMPTED, TIMEOUT, REQUEUED)."""
        argv = ["sacct", "--noheader", "--parsable2", "--allocations", "--duplicates"]
        try:
            rows = self.slurm([*argv, "--jobs", job_id, "--format=State"], "sacct failed")
        except SlurmRefused:
            return "requeued"
        states = [row.split()[0] for row in rows.stdout.splitlines() if row.strip()]
        # The newest row is the job as it is now (pending again, or running); the one before it
        # is how the run that was requeued ended (REQUEUED: an `scontrol requeue`).
        earlier = [state for state in states[:-1] if state not in ("PENDING", "RUNNING")]
        if not earlier:
            return "requeued"
        return {"REQUEUED": "scontrol requeue"}.get(earlier[-1], earlier[-1])

    # stop ---------------------------------------------------------------------------------------
    def stop(
        self, run: RunDir, probe: Probe, timeout: float, leave_out: set[str]
    ) -> list[HostStop]:
        """SIGTERM to every task of the job's steps (the trainer checkpoints and exits 0; the
        batch script sees the recorded request and cancels its job), wait, then cancel whatever
        is left.

        Not `--full`: that signals the batch step too, whose srun answers SIGTERM by terminating
        the training step (SIGKILL after KillWait) before the trainer can checkpoint (seen on
        the rig with Slurm 22.05)."""
        if job_id_of(run) is None:
            raise RlmctlError(f"run {run.name} has no Slurm job recorded ({run.path / JOB_FILE})")
        if (read_json(run.path / JOB_FILE) or {}).get("chain"):
            # The chain's later segments first, so that none starts when this one ends.
            self.slurm(["scancel", "--state=PENDING", f"--name={run.name}"], "scancel failed")
        current = self.current(run)
        job_id = current.job_id
        if not current.ended:
            if current.state == "RUNNING":
                self.slurm(["scancel", "--signal=TERM", job_id], "scancel failed")
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    state = run.state()
                    if state is not None and not state.active:
                        break
                    time.sleep(1)  # polling the run directory, not a synchronisation
            self.slurm(["scancel", job_id], "scancel failed")
            deadline = time.monotonic() + 60
            current = self.job(job_id)
            while not current.ended and time.monotonic() < deadline:
                time.sleep(1)  # polling Slurm until it has ended the job
                current = self.job(job_id)
        error = None if current.ended else f"Slurm job {current.job_id} is still {current.state}"
        return [HostStop(current.nodes or "-", ok=current.ended, error=error)]

    def failed_hosts(self, run: RunDir, probe: Probe) -> list[str]:
        """The nodes a failed job must not get again, from each node's exit record
        (hosts/<node>/exit.json, written by the batch script's node wrapper when its torchrun
        ends): the node whose torchrun ended first with a non-zero code before anyone signalled
        it (the others were brought down after it: `srun --kill-on-bad-exit`, or a collective
        with the dead peer); failing that, the job's nodes with no record (the wrapper itself
        was lost with its node); and the job's nodes that Slurm now has drained or down."""
        if not probe.job or not probe.job.get("job_id"):
            return []
        ended = Job(**probe.job)
        nodes = self.job_nodes(ended)
        records = exit_records(run, ended.job_id, nodes)
        first = sorted(
            (float(r["time"]), node)
            for node, r in records.items()
            if r.get("launcher_exit_code", r["exit_code"]) != 0 and r.get("signalled") is not True
        )
        bad = {first[0][1]} if first else {n for n in nodes if n not in records}
        bad |= {n for n, state in self.node_states(nodes).items() if state.startswith(OUT)}
        return sorted(bad)

    def node_states(self, nodes: list[str]) -> dict[str, str]:
        """Each of `nodes` with its `sinfo %T` state (a node is listed once per partition)."""
        if not nodes:
            return {}
        argv = ["sinfo", "--noheader", "--Node", f"--nodes={','.join(nodes)}", "--format=%N|%T"]
        rows = (
            row.strip().partition("|")
            for row in self.slurm(argv, "sinfo failed").stdout.splitlines()
        )
        return {node: state for node, _, state in rows if node}

    def in_service(self, hosts: list[str]) -> dict[str, str]:
        """The `hosts` Slurm has in service (`IN_SERVICE`): its health check (the role's
        HealthCheckProgram, rlmctl's host checks) drains a node that fails it, and a node an
        operator took out stays drained or down until resumed."""
        return {
            node: f"Slurm has it {state}"
            for node, state in self.node_states(hosts).items()
            if node in hosts and state.rstrip("-") in IN_SERVICE
        }

    def log_paths(self, run: RunDir, host: str | None) -> dict[str, Path]:
        """The job output files (all nodes' tasks are in one per job)."""
        if host is not None:
            raise RlmctlError(
                f"run {run.name} ran under Slurm: its output is one file per job, not per host; "
                f"drop --host"
            )
        return {p.stem: p for p in sorted(run.path.glob("slurm-*.out"))}

    def node_checks(self, report: Report) -> None:
        """`rlmctl health` under Slurm: each node's `sinfo` state as a `slurm` check next to the
        host checks. Drained or draining is WARN with Slurm's reason (jobs avoid it; the health
        check or an operator put it there), down is CRIT (with the munge fix where the node's
        key differs from the controller's), idle/allocated/mixed OK."""
        try:
            argv = ["sinfo", "--noheader", "--Node", "--format=%N|%T|%E"]
            out = self.slurm(argv, "sinfo failed").stdout
        except RlmctlError as error:  # Slurm's refusal, or no submitter (rlm_service_user)
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
        keys = self.munge_mismatches(silent) if silent else {}
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

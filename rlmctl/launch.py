"""Launch a run on the cluster, look at it, stop it.

A launch: fast health gate → run directory on the shared filesystem (runcontract.rundir),
created exclusively (mkdir) and filled with the effective config, then indexed in the registry →
on every host, detached and in a session of its own, `torchrun` with a c10d rendezvous on the
first host, running `python -m trainer train`. What was started (PID, PGID, command) goes to
hosts/<host>/launch.json and to the registry; the exit code of torchrun to hosts/<host>/exit.json
when it ends. A launch that stops before any host started (Ctrl-C, a failed start) removes what it
made, so the name stays free.

State changes are events in the run directory (`RunDir.record`); the registry holds no state.
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterspec.inventory import Host, Inventory
from rlmctl import health
from rlmctl.errors import RlmctlError
from rlmctl.health import Report
from rlmctl.records import (
    CheckpointRow,
    HostProcesses,
    HostStop,
    Launched,
    RunStatus,
    RunSummary,
    StopResult,
)
from rlmctl.registry import Registry, registry_path
from rlmctl.remote import Fleet, Result, python_command
from rlmctl.scheduler import LaunchRequest, Say, Site
from runcontract import config as trainer_config
from runcontract.errors import UserError
from runcontract.exitcodes import ExitCode
from runcontract.rundir import RunDir, check_run_name, read_json, write_json_atomic

if TYPE_CHECKING:
    from rlmctl.supervise import WatchPolicy


class GateRefused(RlmctlError):
    """Hosts failed the health gate; exit code 1 (a check is critical), not a usage error."""

    exit_code = 1


def _quiet(_: str) -> None:
    pass


def runs_root(hosts: list[Host]) -> Path:
    roots = {h.shared_dir for h in hosts}
    if len(roots) > 1:
        raise RlmctlError(
            f"selected hosts disagree on rlm_shared_dir ({', '.join(sorted(roots))}); "
            "set it once for the whole group in the inventory"
        )
    return hosts[0].runs_dir


def open_registry(hosts: list[Host], readonly: bool = False) -> Registry:
    return Registry(registry_path(runs_root(hosts)), readonly=readonly)


def hostproc_command(host: Host, action: str, config: dict[str, Any]) -> str:
    script = Path(__file__).with_name("hostproc.py").read_text(encoding="utf-8")
    payload = base64.b64encode(json.dumps(config).encode()).decode()
    return python_command(host.script_python, script, action, payload)


def parse_json_result(result: Result) -> dict[str, Any] | None:
    if not result.ok:
        return None
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


# config -------------------------------------------------------------------------------------------
def resolve_config(config_file: Path, overrides: list[str], run_dir: Path, world: int) -> str:
    """The trainer's own parsing and validation (runcontract.config, torch-free), as YAML text."""
    try:
        cfg = trainer_config.load_config(config_file, [*overrides, f"run_dir={run_dir}"])
        trainer_config.validate(cfg)
        trainer_config.check_world_size(cfg, world)
    except UserError as error:
        raise RlmctlError(f"{config_file}: {error}") from None
    return trainer_config.dump_yaml(cfg)


def world_size(hosts: list[Host]) -> int:
    return sum(h.gpus_per_node for h in hosts)


# gate ---------------------------------------------------------------------------------------------
def gate(
    fleet: Fleet, hosts: list[Host], force: bool, say: Say
) -> tuple[list[Host], health.Report]:
    """The hosts in launch order and the report; refuses when any failed unless `force`."""
    say(f"health gate on {len(hosts)} host(s)")
    report = health.run_checks(fleet, hosts)
    for host_health in report.failed:
        for check in host_health.critical:
            say(f"  {host_health.host}: {check.name} CRIT: {check.detail}")
    failed = {h.host for h in report.failed}
    if failed and not force:
        raise GateRefused(
            f"health gate failed on {len(failed)} host(s): {', '.join(sorted(failed))}; "
            "fix them (rlmctl health), --exclude them, or --force"
        )
    # Forced: hosts that failed go last, so that --nodes N prefers the healthy ones.
    healthy = [h for h in hosts if h.name not in failed]
    return healthy + [h for h in hosts if h.name in failed], report


# start --------------------------------------------------------------------------------------------
@dataclass
class Started:
    launch_id: int
    hosts: list[str]
    rdzv_endpoint: str


def trainer_argv(
    host: Host, hosts: list[Host], run: RunDir, rdzv_id: str, overrides: list[str]
) -> list[str]:
    first = hosts[0]
    return [
        host.python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(hosts)}",
        f"--nproc-per-node={host.gpus_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={first.address}:{first.rdzv_port}",
        f"--rdzv-id={rdzv_id}",
        "--max-restarts=0",  # rlmctl watch restarts the whole job from a checkpoint instead
        "-m",
        "trainer",
        "train",
        "--config",
        str(run.config_path),
        f"run_dir={run.path}",
        *overrides,
    ]


def host_start_config(host: Host, run: RunDir, argv: list[str]) -> dict[str, Any]:
    """What hostproc's `start` gets for one host: the launcher's command line and environment,
    its log and exit record, and the run and host that name its systemd unit and find its
    processes (the same two keys `status` and `stop` get)."""
    env = {**host.comm_env, "PYTHONUNBUFFERED": "1"}
    env |= {"RLMCTL_RUN": str(run.path), "RLMCTL_HOST": host.name}
    return {
        "run_dir": str(run.path),
        "host": host.name,
        "argv": argv,
        "env": env,
        "log": str(run.launcher_log_path(host.name)),
        "exit_file": str(run.exit_record_path(host.name)),
        "cwd": host.shared_dir,
    }


def start(
    fleet: Fleet,
    registry: Registry,
    name: str,
    run: RunDir,
    hosts: list[Host],
    kind: str,
    say: Say = _quiet,
    overrides: list[str] | None = None,
) -> Started:
    """Start the trainer on every host, detached; all-or-nothing."""
    rdzv_id = f"{name}-{len(registry.launches(name)) + 1}-{secrets.token_hex(3)}"
    endpoint = f"{hosts[0].address}:{hosts[0].rdzv_port}"
    configs: dict[str, dict[str, Any]] = {}
    for host in hosts:
        run.host_dir(host.name).mkdir(parents=True, exist_ok=True)
        argv = trainer_argv(host, hosts, run, rdzv_id, overrides or [])
        configs[host.name] = host_start_config(host, run, argv)
    say(f"starting torchrun on {len(hosts)} host(s), rendezvous {endpoint} id {rdzv_id}")
    results = fleet.run(lambda h: hostproc_command(h, "start", configs[h.name]), hosts=hosts)
    processes, failures = [], []
    for host, result in zip(hosts, results, strict=True):
        started = parse_json_result(result)
        if started is None:
            failures.append(f"{host.name}: {result.reason}")
            continue
        record = {"host": host.name, "address": host.address, **started}
        record |= {"argv": configs[host.name]["argv"], "rdzv_id": rdzv_id, "kind": kind}
        record["rdzv_endpoint"] = endpoint
        write_json_atomic(run.launch_record_path(host.name), record)
        processes.append(record)
    if not processes:
        raise GateRefused(f"could not start on any host: {'; '.join(failures)}")
    launch_id = registry.record_launch(name, kind, processes, rdzv_id, endpoint)
    run.record("launched", launch=kind, hosts=[p["host"] for p in processes], rdzv_id=rdzv_id)
    if failures:
        stop(fleet, registry, name, timeout=10)
        run.record("launch_failed", reason="; ".join(failures))
        raise GateRefused(f"could not start on {len(failures)} host(s): {'; '.join(failures)}")
    return Started(launch_id, [h.name for h in hosts], endpoint)


def run_name(config_file: Path, name: str | None) -> str:
    """The run's name (default: config stem + time), checked; the config file must exist."""
    if not Path(config_file).is_file():
        raise RlmctlError(f"config file {config_file} does not exist; pass --config FILE")
    name = name or f"{Path(config_file).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    problem = check_run_name(name)
    if problem:
        raise RlmctlError(f"{problem}; pass another --name")
    return name


def _exists(run: RunDir, name: str) -> RlmctlError:
    return RlmctlError(
        f"run {name!r} already exists ({run.path}); pick another --name or `rlmctl resume {name}`"
    )


def refuse_existing(run: RunDir, registry: Registry, name: str) -> None:
    """A cheap early answer; the exclusive create in claim_run is what decides."""
    if run.path.exists() or any(r["name"] == name for r in registry.runs()):
        raise _exists(run, name)


def claim_run(
    run: RunDir, registry: Registry, inventory: Inventory, config_text: str, name: str
) -> None:
    """Create the run directory exclusively with its config, then index it."""
    record = {"inventory": str(inventory.source), "created": time.time(), "by": "rlmctl launch"}
    try:
        run.create_exclusive(config_text, record)
    except FileExistsError:
        raise _exists(run, name) from None
    except OSError as error:
        raise RlmctlError(f"cannot create the run directory {run.path}: {error.strerror}") from None
    try:
        registry.add_run(name, str(run.path), str(inventory.source), record["created"])
    except BaseException:
        run.discard()
        raise


def launch(
    fleet: Fleet,
    inventory: Inventory,
    hosts: list[Host],
    config_file: Path,
    name: str | None,
    nodes: int | None,
    force: bool,
    overrides: list[str],
    say: Say = _quiet,
) -> tuple[str, RunDir, Started]:
    name = run_name(config_file, name)
    if nodes is not None and not 1 <= nodes <= len(hosts):
        raise RlmctlError(f"--nodes {nodes}: the selection has {len(hosts)} host(s)")
    run = RunDir(runs_root(hosts) / name)
    registry = open_registry(hosts)
    refuse_existing(run, registry, name)
    # Validate before touching any host: a bad config must not cost a health round trip.
    resolve_config(config_file, overrides, run.path, world_size(hosts[: nodes or len(hosts)]))
    healthy, _ = gate(fleet, hosts, force, say)
    chosen = healthy[: nodes or len(hosts)]
    if nodes and len(chosen) < nodes:
        raise GateRefused(f"only {len(chosen)} healthy host(s), --nodes asks for {nodes}")
    config_text = resolve_config(config_file, overrides, run.path, world_size(chosen))
    claim_run(run, registry, inventory, config_text, name)
    try:
        say(f"run {name}: {run.path}")
        started = start(fleet, registry, name, run, chosen, "launch", say)
    except BaseException:
        # Nothing may outlive an interrupted launch: stop whatever did start, then free the name
        # unless a trainer got as far as recording a start.
        with contextlib.suppress(Exception):
            stop(fleet, registry, name, timeout=10, hosts=chosen)
        if not any(e.kind == "start" for e in run.events()):
            registry.remove_run(name)
            run.discard()
        raise
    return name, run, started


# look ---------------------------------------------------------------------------------------------
def run_hosts(inventory: Inventory, registry: Registry, name: str) -> tuple[RunDir, list[Host]]:
    run = registry.run(name)
    names = [h["host"] for h in registry.hosts(name)]
    missing = [n for n in names if n not in inventory.hosts]
    if missing:
        raise RlmctlError(
            f"run {name} ran on {', '.join(missing)}, which {inventory.source} does not list; "
            "use the inventory the run was launched with: -i " + run["inventory"]
        )
    return RunDir(run["run_dir"]), [inventory.hosts[n] for n in names]


def processes(
    fleet: Fleet, registry: Registry, name: str, run: RunDir, hosts: list[Host]
) -> dict[str, HostProcesses]:
    """Per host: alive (bool, or None when the host did not answer), process count, error."""
    records = {h["host"]: h for h in registry.hosts(name)}

    def command(host: Host) -> str:
        record = records.get(host.name, {})
        config = {"run_dir": str(run.path), "host": host.name}
        return hostproc_command(
            host, "status", config | {k: record.get(k) for k in ("pid", "pgid")}
        )

    results = fleet.run(command, hosts=hosts)
    out = {}
    for result in results:
        parsed = parse_json_result(result)
        out[result.host] = HostProcesses(
            host=result.host,
            alive=parsed["alive"] if parsed else None,
            processes=len(parsed["processes"]) if parsed else None,
            error=None if parsed else result.reason,
        )
    return out


def exit_code(run: RunDir, hosts: list[str], since: float) -> int | None:
    """Why the launch of `since` ended: the trainer's own non-zero code (its exit event, then
    status.json) first,
    then the first failing torchrun code of `hosts` (hosts/<host>/exit.json), else 0.

    torchrun turns every worker failure into 1, and a worker stopped by its launcher reports a
    clean 0, so neither alone tells a crash from a config error or a requested stop.
    """
    # The trainer's own `exit` event first: it is written even when a failed start leaves
    # status.json as an earlier run left it.
    exits = [e for e in run.events() if e.kind == "exit" and e.time >= since]
    own = exits[-1].fields.get("exit_code") if exits else None
    if isinstance(own, int) and own != 0:
        return own
    status = run.read_status()
    fresh = float(status.get("updated", 0)) >= since and "exit_code" in status
    if fresh and int(status["exit_code"]) != 0:
        return int(status["exit_code"])
    codes = []
    for host in hosts:
        record = read_json(run.exit_record_path(host))
        if isinstance(record, dict) and float(record.get("time", 0)) >= since - 1:
            codes.append(int(record["exit_code"]))
    failing = [c for c in codes if c != 0]
    if failing:
        return failing[0]
    if fresh:
        return int(status["exit_code"])
    return 0 if codes else None


def restartable(code: int | None) -> bool:
    """Killed by a signal (128+n) or unknown counts as a crash; config/data errors do not."""
    if code is None or code >= 128:
        return True
    try:
        return ExitCode(code).restartable
    except ValueError:
        return True


def status(fleet: Fleet, registry: Registry, inventory: Inventory, name: str) -> RunStatus:
    """The run's state of record with what its processes say; reads only."""
    run, hosts = run_hosts(inventory, registry, name)
    procs = processes(fleet, registry, name, run, hosts)
    state = run.state()
    alive = [h for h, p in procs.items() if p.alive]
    unknown = [h for h, p in procs.items() if p.alive is None]
    problem = None
    if unknown:
        problem = f"no answer from {', '.join(unknown)}"
    elif state is not None and state.active and len(alive) < len(procs):
        dead = [h for h, p in procs.items() if not p.alive]
        problem = (
            f"recorded {state.value} but no trainer process is alive on {', '.join(dead)}; "
            f"see `rlmctl logs {name}`, then `rlmctl stop {name}` or `rlmctl resume {name}`"
        )
    elif state is not None and not state.active and alive:
        problem = f"recorded {state.value} but processes remain on {', '.join(alive)}"
    return RunStatus(
        run=name,
        state=state,
        run_dir=str(run.path),
        hosts=list(procs.values()),
        problem=problem,
        **progress_fields(run),
    )


def progress_fields(run: RunDir) -> dict[str, Any]:
    """What a run directory says of a run's progress, for RunStatus."""
    progress = run.status()
    latest = run.latest_valid_checkpoint()
    return {
        "step": progress.step,
        "max_steps": progress.max_steps,
        "loss": progress.loss,
        "tokens_per_s": progress.tokens_per_s,
        "updated": progress.updated,
        "exit_code": progress.exit_code,
        "checkpoint": checkpoint_row(latest) if latest else None,
        "restarts": run.restarts(),
    }


def summaries(registry: Registry) -> list[RunSummary]:
    """Every indexed run with its state and restarts read from its run directory."""
    out = []
    for row in registry.runs():
        run = RunDir(row["run_dir"])
        out.append(
            RunSummary(
                name=row["name"],
                state=run.state(),
                hosts=[h["host"] for h in registry.hosts(row["name"])],
                restarts=run.restarts(),
                created=row["created"],
                run_dir=row["run_dir"],
                inventory=row["inventory"],
            )
        )
    return out


def checkpoint_row(info: Any) -> CheckpointRow:
    return CheckpointRow(
        step=info.step,
        path=str(info.path),
        valid=info.valid,
        reason=info.reason,
        size_bytes=info.size_bytes,
        age_s=round(info.age_seconds, 1),
    )


# stop ---------------------------------------------------------------------------------------------
def stop(
    fleet: Fleet, registry: Registry, name: str, timeout: float, hosts: list[Host] | None = None
) -> StopResult:
    """SIGTERM every host's processes of the run, SIGKILL after `timeout`; per-host outcome.

    A run that has already ended (done, stopped, failed) with no process left is not touched.
    """
    run = RunDir(registry.run(name)["run_dir"])
    targets = hosts if hosts is not None else fleet.hosts
    state = run.state()
    if state is not None and not state.active:
        procs = processes(fleet, registry, name, run, targets)
        if not any(p.alive or p.processes for p in procs.values()):
            reason = f"run {name} is already {state.value}; nothing to stop"
            return StopResult(name, state, [HostStop(h, True) for h in procs], skipped=reason)
    # Before any signal: a concurrent `rlmctl watch` must read the exits as requested.
    run.record("stop_requested", timeout_s=timeout)
    pgids = {h["host"]: h["pgid"] for h in registry.hosts(name)}
    results = fleet.run(
        lambda h: hostproc_command(
            h,
            "stop",
            {
                "run_dir": str(run.path),
                "host": h.name,
                "pgid": pgids.get(h.name),
                "timeout": timeout,
            },
        ),
        hosts=targets,
        timeout=timeout + 30,
    )
    outcome = []
    for result in results:
        parsed = parse_json_result(result)
        if parsed is None:
            outcome.append(HostStop(result.host, False, error=result.reason))
            continue
        outcome.append(
            HostStop(
                result.host,
                ok=not parsed["remaining"],
                found=parsed["found"],
                killed=len(parsed["killed"]),
                remaining=parsed["remaining"],
                error=None if not parsed["remaining"] else "processes survived SIGKILL",
            )
        )
    if all(o.ok for o in outcome):
        run.record("stopped", hosts=[o.host for o in outcome])
    else:
        run.append_event("stop_failed", hosts=[o.host for o in outcome if not o.ok])
    return StopResult(name, run.state(), outcome)


# the scheduler interface --------------------------------------------------------------------------
class SshScheduler:
    """rlmctl.scheduler.Scheduler for `rlm_scheduler: ssh`: rlmctl itself gates the hosts,
    starts torchrun on each over SSH, tracks and signals its processes."""

    def __init__(self, site: Site) -> None:
        self.site = site

    def launch(self, request: LaunchRequest, say: Say) -> Launched:
        site = self.site
        hosts = site.hosts()
        with site.fleet(hosts) as fleet:
            name, run, started = launch(
                fleet,
                site.inventory(),
                hosts,
                request.config,
                request.name,
                request.nodes,
                request.force,
                request.overrides,
                say,
            )
        return Launched(name, str(run.path), started.hosts, started.rdzv_endpoint)

    def status(self, run: str) -> RunStatus:
        with self.site.registry(readonly=True) as registry, self.site.fleet([]) as fleet:
            return status(fleet, registry, self.site.inventory(), run)

    def stop(self, run: str, timeout: float) -> StopResult:
        with self.site.registry() as registry:
            _, hosts = run_hosts(self.site.inventory(), registry, run)
            with self.site.fleet(hosts) as fleet:
                return stop(fleet, registry, run, timeout)

    def resume(self, run: str, exclude: set[str], force: bool, say: Say) -> Launched:
        from rlmctl import supervise

        site = self.site
        with site.registry() as registry, site.fleet([]) as fleet:
            started = supervise.resume(fleet, site.inventory(), registry, run, exclude, say, force)
            run_dir = registry.run(run)["run_dir"]
        return Launched(run, run_dir, started.hosts, started.rdzv_endpoint, kind="resume")

    def watch(self, run: str, policy: WatchPolicy, say: Say) -> int:
        from rlmctl import supervise

        with self.site.registry() as registry, self.site.fleet([]) as fleet:
            return supervise.watch(fleet, self.site.inventory(), registry, run, policy, say)

    def node_checks(self, fleet: Fleet, report: Report) -> None:
        """The host checks are the whole story over SSH: no scheduler keeps state of a node."""

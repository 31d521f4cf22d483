"""The SSH backend (`rlm_scheduler: ssh`): rlmctl itself gates the hosts, starts torchrun on each
over SSH, tracks and signals its processes.

An attempt: on every host, detached and in a session of its own (or in a transient unit of the
trainer's slice where the host runs systemd), rlmctl's launcher shell (rlmctl/hostproc.py) runs
`torchrun` with a c10d rendezvous on the first host, running `python -m trainer train`. What was
started (PID, PGID, command) goes to hosts/<host>/launch.json and to the registry; the launcher
shell writes how the attempt ended to hosts/<host>/exit.json (`RunDir.end_attempt`: the
trainer's own exit code before torchrun's).
"""

from __future__ import annotations

import base64
import json
import secrets
import shlex
from pathlib import Path
from typing import Any

from clusterspec.inventory import Host
from rlmctl import container, health
from rlmctl.backend import Attempt, LaunchRequest, Placement, Probe, Say, Started
from rlmctl.context import Context
from rlmctl.errors import GateRefused, RlmctlError
from rlmctl.health import Report
from rlmctl.records import HostProcesses, HostStop
from rlmctl.remote import Result, python_command
from runcontract.rundir import RunDir, write_json_atomic
from runcontract.states import EventKind


def hostproc_command(host: Host, action: str, config: dict[str, Any]) -> str:
    script = Path(__file__).with_name("hostproc.py").read_text(encoding="utf-8")
    payload = base64.b64encode(json.dumps(config).encode()).decode()
    return python_command(host.script_python, script, action, payload)


def parse_json_result(result: Result) -> Any:
    if not result.ok:
        return None
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def trainer_argv(
    host: Host, hosts: list[Host], run: RunDir, rdzv_id: str, overrides: list[str]
) -> list[str]:
    first = hosts[0]
    env = [*host.comm_env, "PYTHONUNBUFFERED", "RLMCTL_RUN", "RLMCTL_HOST"]
    python = container.podman_argv(host, env) if host.container_image else [host.python]
    return [
        *python,
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


def launch_line(config: dict[str, Any]) -> str:
    """What hostproc's `start` runs on a host, as a shell line: in the shared directory, with the
    trainer's environment, torchrun's command line, output appended to the launcher log (the
    launcher shell around it records the exit code: hostproc.WRAPPER)."""
    env = " ".join(f"{key}={shlex.quote(value)}" for key, value in config["env"].items())
    return (
        f"cd {shlex.quote(config['cwd'])} && env {env} {shlex.join(config['argv'])} "
        f">> {shlex.quote(config['log'])} 2>&1"
    )


def host_start_config(host: Host, run: RunDir, argv: list[str]) -> dict[str, Any]:
    """What hostproc's `start` gets for one host: the launcher's command line and environment,
    its log and exit record, the training python that ends the attempt (`runcontract.attempt`),
    and the run and host that name its systemd unit and find its processes (the same two keys
    `status` and `stop` get)."""
    env = {**host.comm_env, "PYTHONUNBUFFERED": "1"}
    env |= {"RLMCTL_RUN": str(run.path), "RLMCTL_HOST": host.name}
    return {
        "run_dir": str(run.path),
        "host": host.name,
        "argv": argv,
        "env": env,
        "log": str(run.launcher_log_path(host.name)),
        "exit_file": str(run.exit_record_path(host.name)),
        "python": host.python,
        "cwd": host.shared_dir,
    }


class Backend:
    """rlmctl.backend.Backend over SSH."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    # where ----------------------------------------------------------------------------------------
    def placement(self, request: LaunchRequest) -> Placement:
        if request.site:
            flags = " ".join(f"--{key}" for key in request.site)
            raise RlmctlError(
                f"{flags}: Slurm options, but this inventory's rlm_scheduler is ssh; drop them"
            )
        if request.segments != 1:
            raise RlmctlError("--segments chains Slurm jobs; this inventory's rlm_scheduler is ssh")
        hosts = self.ctx.hosts
        nodes = request.nodes
        if nodes is not None and not 1 <= nodes <= len(hosts):
            raise RlmctlError(f"--nodes {nodes}: the selection has {len(hosts)} host(s)")
        # Until the gate has spoken, the first N of the selection (the world size the config's
        # batch must divide by is checked before any host is contacted).
        chosen = hosts[: nodes or len(hosts)]
        return Placement(
            hosts=chosen,
            nodes=nodes or len(hosts),
            gpus_per_node=chosen[0].gpus_per_node,
            template=chosen[0],
            force=request.force,
        )

    def tend(self, run: RunDir, say: Say) -> None:
        """Nothing: no scheduler to tend."""

    def placement_of(self, run: RunDir, exclude: set[str]) -> Placement:
        hosts = self._run_hosts(run)
        kept = [h for h in hosts if h.name not in exclude]
        if not kept:
            raise GateRefused(
                f"no hosts left for run {run.name} after excluding {', '.join(sorted(exclude))}"
            )
        return Placement(
            hosts=kept, nodes=len(kept), gpus_per_node=kept[0].gpus_per_node, template=kept[0]
        )

    def _run_hosts(self, run: RunDir) -> list[Host]:
        """The hosts of the run's newest attempt, from the registry, as the inventory has them."""
        registry, inventory = self.ctx.registry, self.ctx.inventory
        names = [h["host"] for h in registry.hosts(run.name)]
        missing = [n for n in names if n not in inventory.hosts]
        if missing:
            raise RlmctlError(
                f"run {run.name} ran on {', '.join(missing)}, which {inventory.source} does not "
                "list; use the inventory the run was launched with: -i "
                + registry.run(run.name)["inventory"]
            )
        return [inventory.hosts[n] for n in names]

    def admit(self, run: RunDir, placement: Placement, attempt: Attempt, say: Say) -> Placement:
        """The health gate. A launch refuses when a host fails it (unless forced: failed hosts
        go last, so that --nodes N prefers the healthy ones); a resume leaves failed hosts out
        (unless forced) and records that."""
        candidates = placement.hosts if attempt.kind == "resume" else self.ctx.hosts
        say(f"health gate on {len(candidates)} host(s)")
        report = health.run_checks(self.ctx.fleet, candidates)
        for host_health in report.failed:
            for check in host_health.critical:
                say(f"  {host_health.host}: {check.name} CRIT: {check.detail}")
        failed = {h.host for h in report.failed}
        healthy = [h for h in candidates if h.name not in failed]
        # Forced: hosts that failed go last, so that the rendezvous and --nodes N prefer the
        # healthy ones.
        ordered = healthy + [h for h in candidates if h.name in failed]
        if attempt.kind == "resume":
            if not placement.force and failed:
                say(f"leaving out {', '.join(sorted(failed))} (failed the gate); "
                    f"{len(healthy)} host(s) remain")  # fmt: skip
                run.append_event(
                    EventKind.EXCLUDED, hosts=sorted(failed), reason="failed the health gate"
                )
            chosen = ordered if placement.force else healthy
            if not chosen:
                raise GateRefused(
                    f"every host of run {run.name} failed the gate; see rlmctl health"
                )
        else:
            if failed and not placement.force:
                raise GateRefused(
                    f"health gate failed on {len(failed)} host(s): {', '.join(sorted(failed))}; "
                    "fix them (rlmctl health), --exclude them, or --force"
                )
            chosen = ordered[: placement.nodes]
        return Placement(
            hosts=chosen,
            nodes=len(chosen),
            gpus_per_node=chosen[0].gpus_per_node,
            template=chosen[0],
            force=placement.force,
        )

    # start ----------------------------------------------------------------------------------------
    def attempt_configs(
        self, run: RunDir, placement: Placement, attempt: Attempt, number: int
    ) -> tuple[str, dict[str, dict[str, Any]]]:
        """The rendezvous id of attempt `number` (1 for the launch) and what hostproc's `start`
        gets on each host."""
        hosts = placement.hosts
        rdzv_id = f"{run.name}-{number}-{secrets.token_hex(3)}"
        overrides = [f"checkpoint.resume={attempt.resume_from}"] if attempt.resume_from else []
        overrides += attempt.overrides  # e.g. watch's checkpoint.interval_steps on a restart
        configs = {
            host.name: host_start_config(
                host, run, trainer_argv(host, hosts, run, rdzv_id, overrides)
            )
            for host in hosts
        }
        return rdzv_id, configs

    def commands(self, run: RunDir, placement: Placement, attempt: Attempt) -> dict[str, str]:
        """Per host, the command its launcher shell would run (`--dry-run`): the trainer's
        environment, torchrun's command line, the log; a fresh rendezvous id per attempt."""
        number = 1 if attempt.kind == "launch" else len(self.ctx.registry.launches(run.name)) + 1
        _, configs = self.attempt_configs(run, placement, attempt, number)
        return {name: launch_line(config) for name, config in configs.items()}

    def start(self, run: RunDir, placement: Placement, attempt: Attempt, say: Say) -> Started:
        hosts = placement.hosts
        endpoint = f"{hosts[0].address}:{hosts[0].rdzv_port}"
        number = len(self.ctx.registry.launches(run.name))  # this attempt's row is recorded
        rdzv_id, configs = self.attempt_configs(run, placement, attempt, number)
        for host in hosts:
            run.host_dir(host.name).mkdir(parents=True, exist_ok=True)
        say(f"starting torchrun on {len(hosts)} host(s), rendezvous {endpoint} id {rdzv_id}")
        results = self.ctx.fleet.run(
            lambda h: hostproc_command(h, "start", configs[h.name]), hosts=hosts
        )
        processes, failures = [], []
        for host, result in zip(hosts, results, strict=True):
            started = parse_json_result(result)
            if started is None:
                failures.append(f"{host.name}: {result.reason}")
                continue
            record = {"host": host.name, "address": host.address, **started}
            record |= {"argv": configs[host.name]["argv"], "rdzv_id": rdzv_id}
            record |= {"kind": attempt.kind, "rdzv_endpoint": endpoint}
            write_json_atomic(run.launch_record_path(host.name), record)
            processes.append(record)
        return Started(
            hosts=[p["host"] for p in processes],
            processes=processes,
            rdzv_id=rdzv_id,
            rdzv_endpoint=endpoint,
            failures=failures,
        )

    def abandon(self, run: RunDir) -> bool:
        hosts = self._hosts_of_attempt(run)
        return all(stop.ok for stop in self._signal(run, hosts, timeout=10))

    def _hosts_of_attempt(self, run: RunDir) -> list[Host]:
        """The registry's hosts of the newest attempt, or those its launch records name."""
        try:
            return self._run_hosts(run)
        except RlmctlError:
            return []

    # look -----------------------------------------------------------------------------------------
    def processes(self, run: RunDir, hosts: list[Host]) -> dict[str, HostProcesses]:
        """Per host: launcher alive (None when the host did not answer), process count."""
        records = {h["host"]: h for h in self.ctx.registry.hosts(run.name)}

        def command(host: Host) -> str:
            record = records.get(host.name, {})
            config = {"run_dir": str(run.path), "host": host.name}
            return hostproc_command(
                host, "status", config | {k: record.get(k) for k in ("pid", "pgid")}
            )

        out = {}
        for result in self.ctx.fleet.run(command, hosts=hosts):
            parsed = parse_json_result(result)
            out[result.host] = HostProcesses(
                host=result.host,
                alive=parsed["alive"] if parsed else None,
                processes=len(parsed["processes"]) if parsed else None,
                error=None if parsed else result.reason,
            )
        return out

    def probe(self, run: RunDir) -> Probe:
        procs = self.processes(run, self._run_hosts(run))
        alive = [h for h, p in procs.items() if p.alive]
        dead = [h for h, p in procs.items() if p.alive is False]
        leftovers = [h for h, p in procs.items() if p.alive or p.processes]
        return Probe(
            alive=bool(leftovers),
            running=bool(alive),
            complete=len(alive) == len(procs),
            executing=alive,
            unreachable=[h for h, p in procs.items() if p.alive is None],
            gone=dead if alive else [],
            not_running=f"no trainer process is alive on {', '.join(dead)}",
            still_running=f"processes remain on {', '.join(leftovers)}",
            ended="all trainer processes exited",
            recovery=f"`rlmctl stop {run.name}` or `rlmctl resume {run.name}`",
            hosts=list(procs.values()),
        )

    # stop -----------------------------------------------------------------------------------------
    def stop(
        self, run: RunDir, probe: Probe, timeout: float, leave_out: set[str]
    ) -> list[HostStop]:
        hosts = [h for h in self._run_hosts(run) if h.name not in leave_out]
        return self._signal(run, hosts, timeout)

    def _signal(self, run: RunDir, hosts: list[Host], timeout: float) -> list[HostStop]:
        """SIGTERM every process of the run on `hosts`, SIGKILL after `timeout`."""
        pgids = {h["host"]: h["pgid"] for h in self.ctx.registry.hosts(run.name)}
        results = self.ctx.fleet.run(
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
            hosts=hosts,
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
        return outcome

    def stop_commands(
        self, run: RunDir, probe: Probe, timeout: float, leave_out: set[str]
    ) -> dict[str, str]:
        """Per host, the signals `stop` would send now (`--dry-run`), signalling nothing."""
        hosts = [h for h in self._run_hosts(run) if h.name not in leave_out]
        pgids = {h["host"]: h["pgid"] for h in self.ctx.registry.hosts(run.name)}
        results = self.ctx.fleet.run(
            lambda h: hostproc_command(
                h, "targets", {"run_dir": str(run.path), "host": h.name, "pgid": pgids.get(h.name)}
            ),
            hosts=hosts,
        )
        out = {}
        for result in results:
            parsed = parse_json_result(result)
            if parsed is None:
                out[result.host] = f"# no answer: {result.reason}"
            elif not parsed["processes"]:
                out[result.host] = "# no process of the run: nothing to signal"
            else:
                term = " ".join(str(pid) for pid, _ in parsed["term"])
                names = "; ".join(f"{pid}: {command[:60]}" for pid, command in parsed["term"])
                out[result.host] = (
                    f"kill -TERM {term}  # {names}; then kill -KILL whatever of the run's "
                    f"{len(parsed['processes'])} process(es) is left after {timeout:g} s"
                )
        return out

    def failed_hosts(self, run: RunDir, probe: Probe) -> list[str]:
        """Hosts that stopped answering; a host that fails the gate is left out by the resume."""
        return sorted(probe.unreachable)

    def in_service(self, hosts: list[str]) -> dict[str, str]:
        """None: over SSH a resume runs on the newest attempt's hosts (`placement_of`) and no
        scheduler vouches for a host that stopped answering, so an excluded host stays out
        until an operator launches the run again on it."""
        return {}

    def log_paths(self, run: RunDir, host: str | None) -> dict[str, Path]:
        hosts = [h["host"] for h in self.ctx.registry.hosts(run.name)]
        if host is not None:
            if host not in hosts:
                raise RlmctlError(
                    f"run {run.name} has no host {host!r}; its hosts: {', '.join(hosts)}"
                )
            hosts = [host]
        return {h: run.launcher_log_path(h) for h in hosts}

    def node_checks(self, report: Report) -> None:
        """The host checks are the whole story over SSH: no scheduler keeps state of a node."""

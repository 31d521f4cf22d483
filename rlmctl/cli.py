"""`rlmctl`: operate depth-recurrent LM training runs on a cluster described by an Ansible inventory.

Global options (-i, --limit, --exclude, --forks, --timeout) may stand before or after the command,
and every command's help lists them. Exit codes: 0 ok, 1 some hosts failed or a check is critical,
2 usage or input error, 130 interrupted. Every command takes `--json` (typed values on stdout;
progress stays on stderr). Heavy modules (ansible, fabric, torch) are imported inside the commands
that need them. Commands get typed records from the modules below and hand them to rlmctl.render.
"""

from __future__ import annotations

import copy
import functools
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from rlmctl import render
from rlmctl.context import Context, Site
from rlmctl.errors import InventoryError, RlmctlError, RunNotFound
from rlmctl.wheelhouse import command as wheelhouse_command
from runcontract.stragglers import DEFAULT_MARGIN as STRAGGLER_MARGIN
from runcontract.stragglers import DEFAULT_WINDOWS as STRAGGLER_WINDOWS

app = typer.Typer(
    name="rlmctl",
    help="Operate depth-recurrent LM training runs on a cluster described by an Ansible inventory.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
GLOBAL_PANEL = "Global options (before or after the command)"


def _site(ctx: typer.Context) -> Site:
    site: Site = ctx.obj
    return site


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("rlm-ops")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        print(f"rlmctl {version()}")
        raise typer.Exit(0)


JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
# Slurm's site options (docs/slurm.md): each replaces the inventory's rlm_slurm_<key>.
AccountOpt = Annotated[str | None, typer.Option(help="Slurm account (default: rlm_slurm_account).")]
QosOpt = Annotated[str | None, typer.Option(help="Slurm QOS (default: rlm_slurm_qos).")]
ReservationOpt = Annotated[
    str | None, typer.Option(help="Slurm reservation (default: rlm_slurm_reservation).")
]
ConstraintOpt = Annotated[
    str | None, typer.Option(help="Slurm node features (default: rlm_slurm_constraint).")
]
SegmentsOpt = Annotated[
    int,
    typer.Option(
        help="Slurm: N jobs of --time each, chained (afterany), each resuming from the "
        "one before, so the run goes on past the partition's time limit."
    ),
]


def _site_flags(**given: str | None) -> dict[str, str]:
    return {key: value for key, value in given.items() if value is not None}


DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Print exactly what would be run (per host, or the batch script) and change nothing.",
    ),
]


@app.callback()
def main_options(
    ctx: typer.Context,
    inventory: Annotated[
        str,
        typer.Option(
            "-i",
            "--inventory",
            envvar="RLM_INVENTORY",
            help="Ansible inventory (file or directory).",
        ),
    ] = "inventory/local",
    limit: Annotated[
        str | None, typer.Option("--limit", "-l", help="Ansible host pattern to act on.")
    ] = None,
    exclude: Annotated[
        str | None, typer.Option("--exclude", help="Ansible host pattern to leave out.")
    ] = None,
    forks: Annotated[int, typer.Option(help="Hosts contacted in parallel.", min=1)] = 128,
    timeout: Annotated[
        float, typer.Option(help="Seconds a remote command may take per host.", min=1)
    ] = 60.0,
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print rlmctl's version and exit.",
            is_eager=True,
            callback=_print_version,
        ),
    ] = False,
) -> None:
    ctx.obj = Site(inventory, limit, exclude, forks, timeout)


# inventory / health -------------------------------------------------------------------------------
@app.command("inventory")
def inventory_cmd(ctx: typer.Context, json_output: JsonOpt = False) -> None:
    """Show the selected hosts: where SSH goes for each (as Ansible's ssh would go), groups,
    GPUs."""
    with Context(_site(ctx), readonly=True) as session:
        hosts = session.hosts
        source = str(session.inventory.source)
        # Where SSH goes for each host, as `ssh` resolves it for Ansible (None: local).
        routes = {h.name: None if h.is_local else session.fleet.endpoint(h) for h in hosts}
        if json_output:
            groups = session.inventory.groups
            rows = [
                h.as_dict() | {"ssh": route.as_dict() if (route := routes[h.name]) else None}
                for h in hosts
            ]
            render.emit_json({"source": source, "groups": groups, "hosts": rows})
        else:
            render.inventory(source, hosts, routes)


@app.command()
def health(
    ctx: typer.Context,
    deep: Annotated[
        bool, typer.Option(help="Also run a real all-reduce across the hosts (slow).")
    ] = False,
    json_output: JsonOpt = False,
) -> None:
    """The pre-launch gate: one round trip per host; exit 1 when a check is CRIT. Keeps its
    report for `rlmctl accept` (a --deep run's apart, never replaced by a plain one)."""
    from rlmctl import health as health_checks
    from rlmctl import lifecycle

    with Context(_site(ctx), readonly=True) as session:
        hosts = session.hosts
        with render.progress(f"health checks on {len(hosts)} host(s)", len(hosts)) as advance:
            session.fleet.on_result = lambda _: advance(1)
            report = health_checks.run_checks(session.fleet)
        lifecycle.backend_for(session).node_checks(report)  # e.g. Slurm's drain/down per node
        deep_result = None
        if deep:
            from rlmctl import deep as deep_checks

            healthy = [h for h in hosts if h.name in report.healthy]
            waiting = f"all-reduce across {len(healthy)} host(s)"
            with render.progress(waiting, len(healthy)) as advance:
                session.fleet.on_result = lambda _: advance(1)
                deep_result = deep_checks.run(session.fleet, healthy)
    result = report.as_dict() | ({"deep": deep_result.as_dict()} if deep_result else {})
    health_checks.save_last_report(result, hosts[0].shared_dir)  # for `rlmctl accept`
    if json_output:
        render.emit_json(result)
    else:
        render.health(report)
        if deep_result:
            render.line(deep_result.summary())
    critical = report.state == "CRIT" or (deep_result is not None and not deep_result.ok)
    raise typer.Exit(1 if critical else 0)


@app.command()
def accept(ctx: typer.Context, run: str, json_output: JsonOpt = False) -> None:
    """The go-live verdict of a run: every criterion with threshold, measured value,
    PASS/FAIL/NO DATA/N/A and source; writes <run_dir>/acceptance.md with plots. Exit 1 when
    one FAILs."""
    from rlmctl import accept as acceptance

    with Context(_site(ctx), readonly=True) as session:
        host = session.hosts[0]
        run_dir = session.run(run)
    verdict = acceptance.run(
        run, run_dir, acceptance.prometheus_api(host), host.accept_thresholds, host.shared_dir
    )
    if json_output:
        render.emit_json(verdict)
    else:
        render.acceptance(verdict)
    raise typer.Exit(0 if verdict.accepted else 1)


# launch / status / logs / stop ----------------------------------------------------------------------
@app.command()
def launch(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option("--config", "-c", help="Trainer config YAML.")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Config overrides, key=value (e.g. train.steps=500).")
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Run name (default: config stem + time).")
    ] = None,
    nodes: Annotated[int | None, typer.Option(help="Use only the first N healthy hosts.")] = None,
    force: Annotated[bool, typer.Option(help="Launch even when the health gate fails.")] = False,
    partition: Annotated[
        str | None, typer.Option(help="Slurm partition (rlm_scheduler slurm).")
    ] = None,
    time_limit: Annotated[str, typer.Option("--time", help="Slurm time limit.")] = "24:00:00",
    memory_check: Annotated[
        bool,
        typer.Option(
            help="Refuse a config whose memory estimate per GPU (rlmctl plan) exceeds "
            "rlm_gpu_memory_gib; --no-memory-check launches it anyway."
        ),
    ] = True,
    account: AccountOpt = None,
    qos: QosOpt = None,
    reservation: ReservationOpt = None,
    constraint: ConstraintOpt = None,
    segments: SegmentsOpt = 1,
    dry_run: DryRunOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Check the config and its memory estimate, gate, create the run directory, and start
    torchrun on every host (detached), or submit the batch job to Slurm (rlm_scheduler: slurm)."""
    from rlmctl import lifecycle

    request = launch_request(
        config,
        overrides,
        name,
        nodes,
        force,
        partition,
        time_limit,
        memory_check,
        _site_flags(account=account, qos=qos, reservation=reservation, constraint=constraint),
        segments,
    )
    with Context(_site(ctx), readonly=dry_run) as session:
        backend = lifecycle.backend_for(session)
        if dry_run:
            planned = lifecycle.plan_launch(session, backend, request)
            return render.dry_run(planned, json_output)
        launched = lifecycle.launch(session, backend, request, render.say())
    if json_output:
        render.emit_json(launched)
    elif launched.job_id:
        render.line(
            f"submitted {launched.run} as Slurm job {launched.job_id}; "
            f"`rlmctl status {launched.run}`"
        )
    else:
        render.line(
            f"launched {launched.run} on {len(launched.hosts)} host(s); follow it with "
            f"`rlmctl status {launched.run}`, `rlmctl logs {launched.run} -f` or "
            f"`rlmctl watch {launched.run}`"
        )


def launch_request(
    config: Path,
    overrides: list[str] | None,
    name: str | None,
    nodes: int | None,
    force: bool = False,
    partition: str | None = None,
    time_limit: str = "24:00:00",
    memory_check: bool = True,
    site: dict[str, str] | None = None,
    segments: int = 1,
) -> Any:
    from rlmctl.backend import LaunchRequest

    for text in overrides or []:
        if "=" not in text:
            raise RlmctlError(f"override {text!r} must look like key=value, e.g. train.steps=500")
    return LaunchRequest(
        config,
        overrides or [],
        name,
        nodes,
        force,
        partition,
        time_limit,
        memory_check,
        site or {},
        segments,
    )


@app.command()
def status(ctx: typer.Context, run: str, json_output: JsonOpt = False) -> None:
    """State of record, processes per host and progress; exit 1 when the run failed or its
    processes disagree with its state. Reads only."""
    from rlmctl import lifecycle

    with Context(_site(ctx), readonly=True) as session:
        info = lifecycle.status(session, lifecycle.backend_for(session), run)
    if json_output:
        render.emit_json(info)
    else:
        render.status(info)
    raise typer.Exit(0 if info.ok else 1)


@app.command()
def logs(
    ctx: typer.Context,
    run: str,
    host: Annotated[str | None, typer.Option(help="Only this host's launcher log.")] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines.")
    ] = False,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines of history per host.")] = 40,
    json_output: Annotated[
        bool, typer.Option("--json", help='One JSON object per line: {"host": ..., "line": ...}.')
    ] = False,
) -> None:
    """Print the launcher logs (torchrun + trainer output) from the run directory."""
    from rlmctl import lifecycle
    from rlmctl import logs as run_logs

    with Context(_site(ctx), readonly=True) as session:
        paths = lifecycle.log_paths(session, lifecycle.backend_for(session), run, host)
    run_logs.show(paths, lines, follow, sys.stdout, as_json=json_output)


@app.command()
def stop(
    ctx: typer.Context,
    run: str,
    timeout: Annotated[
        float, typer.Option(help="Seconds between SIGTERM (checkpoint and exit) and SIGKILL.")
    ] = 60.0,
    dry_run: DryRunOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Stop a run on every host; verifies that none of its processes remain. A run that has
    already ended is left as it is."""
    from rlmctl import lifecycle

    with Context(_site(ctx), readonly=dry_run) as session:
        backend = lifecycle.backend_for(session)
        if dry_run:
            return render.dry_run(lifecycle.plan_stop(session, backend, run, timeout), json_output)
        waiting = f"stopping {run} (SIGTERM, SIGKILL after {timeout:g} s)"
        with render.progress(waiting, None) as advance:
            session.fleet.on_result = lambda _: advance(1)
            outcome = lifecycle.stop(session, backend, run, timeout)
    if json_output:
        render.emit_json(outcome)
    elif outcome.slurm:
        render.line(f"run {run}: Slurm job {outcome.slurm['job_id']} {outcome.slurm['state']}")
    else:
        render.stopped(outcome)
    raise typer.Exit(0 if outcome.ok else 1)


# resume / watch -----------------------------------------------------------------------------------
@app.command()
def resume(
    ctx: typer.Context,
    run: str,
    force: Annotated[bool, typer.Option(help="Keep hosts that fail the gate.")] = False,
    account: AccountOpt = None,
    qos: QosOpt = None,
    reservation: ReservationOpt = None,
    constraint: ConstraintOpt = None,
    dry_run: DryRunOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Relaunch a stopped or failed run from its newest verified checkpoint (under Slurm with
    the site options it was launched with, less those given here)."""
    from rlmctl import lifecycle

    site = _site(ctx)
    with Context(site, readonly=dry_run) as session:
        excluded = set()
        if site.exclude:
            excluded = {h.name for h in session.inventory.select(site.exclude)}
        backend = lifecycle.backend_for(session)
        site_flags = _site_flags(
            account=account, qos=qos, reservation=reservation, constraint=constraint
        )
        if dry_run:
            planned = lifecycle.plan_resume(
                session, backend, run, excluded, render.say(), site=site_flags
            )
            return render.dry_run(planned, json_output)
        resumed = lifecycle.resume(
            session, backend, run, excluded, force, render.say(), site=site_flags
        )
    if json_output:
        render.emit_json(resumed)
    elif resumed.job_id:
        render.line(f"resubmitted {run} as Slurm job {resumed.job_id}; `rlmctl status {run}`")
    else:
        render.line(f"resumed {run} on {len(resumed.hosts)} host(s): {', '.join(resumed.hosts)}")


@app.command()
def watch(
    ctx: typer.Context,
    run: str,
    poll: Annotated[float, typer.Option(help="Seconds between polls.")] = 5.0,
    stall: Annotated[
        float, typer.Option(help="Seconds without a new step that count as a hang.")
    ] = 300.0,
    restarts: Annotated[int, typer.Option(help="Restart budget.")] = 3,
    backoff: Annotated[
        float, typer.Option(help="Seconds before the first restart (doubles).")
    ] = 10.0,
    checkpoint_interval: Annotated[
        str,
        typer.Option(
            help="On a restart: keep the interval, `auto` (Young/Daly from the measured failure "
            "rate and checkpoint stall), or a number of steps."
        ),
    ] = "keep",
    max_checkpoint_interval: Annotated[
        int | None,
        typer.Option(
            help="Most steps auto may pick (default 1000; at most the go-live limit).", min=1
        ),
    ] = None,
    exclude_stragglers: Annotated[
        bool, typer.Option(help="On a restart, leave out the hosts of persistent stragglers.")
    ] = False,
    straggler_margin: Annotated[
        float,
        typer.Option(help="A straggler's own step time exceeds its peers' by this share.", min=0),
    ] = STRAGGLER_MARGIN,
    straggler_windows: Annotated[
        int, typer.Option(help="...in each of this many metrics windows.", min=1)
    ] = STRAGGLER_WINDOWS,
    strikes: Annotated[
        int,
        typer.Option(
            help="A node named by this many failed attempts stays out of the run; named fewer "
            "times, it comes back once Slurm has it in service again.",
            min=1,
        ),
    ] = 2,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json",
            help='One JSON object per line per decision ({"time": ..., "message": ...}), '
            'then {"run": ..., "exit_code": ..., "state": ...}.',
        ),
    ] = False,
) -> None:
    """Supervise a run: fail fast on a dead process, lost host or hang; restart when it can help."""
    from rlmctl import lifecycle

    if checkpoint_interval not in ("keep", "auto") and not checkpoint_interval.isdigit():
        raise RlmctlError(
            f"--checkpoint-interval {checkpoint_interval!r} must be keep, auto or a number of "
            "steps, e.g. --checkpoint-interval auto"
        )
    policy = lifecycle.WatchPolicy(
        poll_s=poll,
        stall_s=stall,
        max_restarts=restarts,
        backoff_s=backoff,
        checkpoint_interval=checkpoint_interval,
        max_interval=max_checkpoint_interval,
        exclude_stragglers=exclude_stragglers,
        straggler_margin=straggler_margin,
        straggler_windows=straggler_windows,
        strikes=strikes,
    )
    say = render.say()
    if json_output:

        def say(message: str) -> None:
            render.emit_json_line({"time": time.time(), "message": message})

    with Context(_site(ctx)) as session:
        backend = lifecycle.backend_for(session)
        code = lifecycle.watch(session, backend, run, policy, say)
        state = session.run(run).state()
    if json_output:
        render.emit_json_line({"run": run, "exit_code": code, "state": render.state_name(state)})
    raise typer.Exit(code)


# registry views -----------------------------------------------------------------------------------
@app.command()
def runs(ctx: typer.Context, json_output: JsonOpt = False) -> None:
    """Runs in the registry, oldest first, with their state from their run directories."""
    from rlmctl import lifecycle

    with Context(_site(ctx), readonly=True) as session:
        root = str(session.runs_root)
        try:
            rows = lifecycle.summaries(session)
        except RunNotFound:  # no registry yet
            rows = []
    if json_output:
        render.emit_json(rows)
    else:
        render.runs(rows, root)


@app.command()
def reindex(ctx: typer.Context, json_output: JsonOpt = False) -> None:
    """Rebuild the registry (an index) from the run directories under rlm_shared_dir/runs."""
    from rlmctl.registry import reindex as rebuild

    with Context(_site(ctx)) as session:
        added = rebuild(session.registry, session.runs_root)
    if json_output:
        render.emit_json({"indexed": added})
    else:
        render.line(f"indexed {len(added)} run(s): {', '.join(added) or '-'}")


@app.command()
def checkpoints(
    ctx: typer.Context,
    run: str,
    verify: Annotated[
        bool, typer.Option(help="Also compare sha256 digests (reads every byte).")
    ] = False,
    json_output: JsonOpt = False,
) -> None:
    """A run's checkpoints with their verification; exit 1 when one is invalid."""
    from rlmctl.lifecycle import checkpoint_row, verify_checkpoints

    with Context(_site(ctx), readonly=True) as session:
        run_dir = session.run(run)
    infos = run_dir.checkpoints()
    if verify:
        total = sum(i.size_bytes for i in infos) / 2**20
        waiting = f"sha256 of {len(infos)} checkpoint(s)"
        with render.progress(waiting, total, "MiB") as advance:
            infos = verify_checkpoints(infos, lambda done: advance(done.size_bytes / 2**20))
    rows = [checkpoint_row(info) for info in infos]
    if json_output:
        render.emit_json(rows)
    else:
        render.checkpoints(run, str(run_dir.path), rows, verify)
    raise typer.Exit(0 if all(r.valid for r in rows) else 1)


# plan / slurm / demo ------------------------------------------------------------------------------
@app.command()
def plan(
    ctx: typer.Context,
    model: Annotated[
        str | None, typer.Option(help="Model preset (tiny, small, 1b, huginn-3.5b).")
    ] = None,
    params: Annotated[
        float | None, typer.Option(help="Parameter count instead of a preset, e.g. 3.5e9.")
    ] = None,
    gpu_mem: Annotated[float, typer.Option("--gpu-mem", help="GiB of memory per GPU.")] = 80.0,
    seq_len: Annotated[
        int | None, typer.Option(help="Sequence length (default: the preset's).")
    ] = None,
    micro_batch: Annotated[int, typer.Option(help="Sequences per GPU per forward.")] = 1,
    gpus: Annotated[int, typer.Option(help="GPUs of the job (for the layout choice).")] = 8,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node (hsdp shard group).")] = 8,
    nodes: Annotated[
        int, typer.Option(help="Nodes of the job (for the checkpoint interval).", min=1)
    ] = 1,
    node_mtbf_hours: Annotated[
        float | None,
        typer.Option(
            help="Mean hours between failures of one node: prints the checkpoint interval."
        ),
    ] = None,
    step_time: Annotated[float | None, typer.Option(help="Seconds per optimizer step.")] = None,
    checkpoint_stall: Annotated[
        float | None, typer.Option(help="Seconds a checkpoint save blocks training.")
    ] = None,
    restart_cost: Annotated[
        float | None, typer.Option(help="Seconds from a failure to training again.")
    ] = None,
    from_run: Annotated[
        str | None,
        typer.Option(help="Take step time, checkpoint stall and restart cost measured by a run."),
    ] = None,
    json_output: JsonOpt = False,
) -> None:
    """Memory per GPU (weights, grads, optimizer, activations) → minimum GPUs, micro-batch, and
    the cheapest of ddp / hsdp / fsdp / offload that fits on --gpus; with --node-mtbf-hours, the
    checkpoint interval that maximises goodput on --nodes nodes (Young/Daly)."""
    from rlmctl import goodput
    from rlmctl import plan as planning

    records: list[object] = []
    if model is not None or params is not None or node_mtbf_hours is None:
        records.append(
            planning.estimate(model, params, gpu_mem, seq_len, micro_batch, gpus, gpus_per_node)
        )
    if node_mtbf_hours is not None:
        if node_mtbf_hours <= 0:
            raise RlmctlError(f"--node-mtbf-hours {node_mtbf_hours} must be > 0, e.g. 50000")
        measured = None
        if from_run is not None:
            with Context(_site(ctx), readonly=True) as session:
                measured = goodput.measured(session.run(from_run))
        stall = checkpoint_stall if checkpoint_stall is not None else measured and measured.stall_s
        if not stall or stall <= 0:
            raise RlmctlError(
                "the checkpoint interval needs the checkpoint stall: pass --checkpoint-stall "
                "SECONDS, or --from-run RUN with a checkpoint saved"
            )
        step = step_time if step_time is not None else measured and measured.step_time_s
        restart = restart_cost if restart_cost is not None else measured and measured.restart_s
        records.append(
            goodput.plan_interval(
                nodes,
                node_mtbf_hours,
                stall,
                restart or 0.0,
                step or None,
                (measured.write_s or 0.0) if measured else 0.0,
                measured.async_save if measured else False,
                source=f"measured by run {from_run}" if measured else "given",
            )
        )
    if json_output:
        render.emit_json(records[0] if len(records) == 1 else records)
    else:
        for record in records:
            if isinstance(record, goodput.IntervalPlan):
                for text in record.lines():
                    render.line(text)
            else:
                render.plan(record)  # type: ignore[arg-type]


@app.command()
def slurm(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option("--config", "-c", help="Trainer config YAML.")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Config overrides, key=value (e.g. train.steps=500).")
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Run name (default: config stem + time).")
    ] = None,
    nodes: Annotated[
        int | None, typer.Option(help="Nodes to allocate (default: the selected hosts).")
    ] = None,
    partition: Annotated[str | None, typer.Option(help="Slurm partition.")] = None,
    time_limit: Annotated[str, typer.Option("--time", help="Slurm time limit.")] = "24:00:00",
    account: AccountOpt = None,
    qos: QosOpt = None,
    reservation: ReservationOpt = None,
    constraint: ConstraintOpt = None,
    json_output: Annotated[
        bool,
        typer.Option("--json", help='{"run", "run_dir", "file", "script"} on stdout.'),
    ] = False,
) -> None:
    """Print the sbatch script `rlmctl launch` submits for these options under rlm_scheduler:
    slurm (the same renderer; launch also creates the run directory and its config.yaml first,
    which the script reads)."""
    from rlmctl import backend_slurm, lifecycle

    site_flags = _site_flags(
        account=account, qos=qos, reservation=reservation, constraint=constraint
    )
    request = launch_request(
        config, overrides, name, nodes, False, partition, time_limit, site=site_flags
    )
    with Context(_site(ctx), readonly=True) as session:
        planned = lifecycle.plan_launch(session, backend_slurm.Backend(session), request)
    (file, script), *_ = planned.commands.items()
    if json_output:
        render.emit_json(
            {"run": planned.run, "run_dir": planned.run_dir, "file": file, "script": script}
        )
    else:
        print(script, end="")


@app.command()
def demo(
    ctx: typer.Context,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 300,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json", help="The demo's outcome as JSON on stdout (its progress on stderr)."
        ),
    ] = False,
) -> None:
    """The whole flow on this machine: prepare data, gate, launch 2 CPU workers, stop, report."""
    from rlmctl import demo as demo_flow

    with Context(_site(ctx)) as session:
        outcome = demo_flow.run(session, steps, quiet=json_output)
    if json_output:
        render.emit_json(outcome)
    raise typer.Exit(outcome["exit_code"])


# The offline wheelhouse builder (rlmctl/wheelhouse.py): needs no inventory.
app.command("wheelhouse")(wheelhouse_command)


# entry point --------------------------------------------------------------------------------------
GLOBAL_OPTIONS = {
    "-i": True,
    "--inventory": True,
    "-l": True,
    "--limit": True,
    "--exclude": True,
    "--forks": True,
    "--timeout": True,
}


@functools.cache
def cli() -> Any:
    """The Click group of `app`, as `rlmctl` runs it: help text as paragraphs (the docstrings'
    line breaks are not the terminal's), and the global options listed in every command's help
    (copies that take no value: main() moves them in front of the command before parsing)."""
    group = typer.main.get_command(app)
    site_options = {"inventory", "limit", "exclude", "forks", "timeout"}
    global_options = [p for p in group.params if p.name in site_options]
    for command in [group, *group.commands.values()]:  # type: ignore[attr-defined]
        command.help = paragraphs(command.help)
        for param in command.params:
            if getattr(param, "help", None):
                param.help = paragraphs(param.help)
    for command in group.commands.values():  # type: ignore[attr-defined]
        own = {opt for p in command.params for opt in getattr(p, "opts", ())}
        for option in global_options:
            if own & set(option.opts):
                continue  # the command's own option of that name (stop --timeout)
            shown = copy.copy(option)
            shown.expose_value = False
            shown.rich_help_panel = GLOBAL_PANEL  # type: ignore[attr-defined]
            shown.global_copy = True  # type: ignore[attr-defined]
            command.params.append(shown)
    return group


def paragraphs(text: str | None) -> str | None:
    """Docstring text with its single line breaks joined: paragraphs stay, hard breaks go."""
    if not text:
        return text
    import inspect

    blocks = re.split(r"\n\s*\n", inspect.cleandoc(text))
    return "\n\n".join(" ".join(block.split()) for block in blocks)


def hoist_global_options(argv: list[str]) -> list[str]:
    """Move global options written after the command in front of it (`rlmctl health --limit x`),
    unless the command has an option of that name itself (`stop --timeout`)."""
    group = cli()
    command_index = next((i for i, word in enumerate(argv) if word in group.commands), None)
    if command_index is None:
        return argv
    command = group.commands[argv[command_index]]
    own = {
        opt
        for p in command.params
        if p.param_type_name == "option" and not getattr(p, "global_copy", False)
        for opt in p.opts
    }
    head, tail, moved = argv[:command_index], argv[command_index + 1 :], []
    rest: list[str] = []
    index = 0
    while index < len(tail):
        word = tail[index]
        key = word.split("=", 1)[0]
        if key in GLOBAL_OPTIONS and key not in own:
            takes_value = "=" not in word
            moved += tail[index : index + (2 if takes_value else 1)]
            index += 2 if takes_value else 1
            continue
        if word == "--":
            rest += tail[index:]
            break
        rest.append(word)
        index += 1
    return [*head, *moved, argv[command_index], *rest]


def main(argv: list[str] | None = None) -> None:
    args = hoist_global_options(list(sys.argv[1:] if argv is None else argv))
    try:
        # Standalone mode: Click prints usage errors itself and exits 2; our errors come here.
        cli()(args=args, prog_name="rlmctl")
    except (RlmctlError, InventoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)

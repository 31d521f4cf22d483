"""`rlmctl`: operate depth-recurrent LM training runs on a cluster described by an Ansible inventory.

Global options (-i, --limit, --exclude, --forks, --timeout) may stand before or after the command.
Exit codes: 0 ok, 1 some hosts failed or a check is critical, 2 usage or input error, 130
interrupted. Heavy modules (ansible, fabric, torch) are imported inside the commands that need
them. Commands get typed records from the modules below and hand them to rlmctl.render.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from rlmctl import render
from rlmctl.context import Context, Site
from rlmctl.errors import InventoryError, RlmctlError, RunNotFound
from runcontract.stragglers import DEFAULT_MARGIN as STRAGGLER_MARGIN
from runcontract.stragglers import DEFAULT_WINDOWS as STRAGGLER_WINDOWS

app = typer.Typer(
    name="rlmctl",
    help="Operate depth-recurrent LM training runs on a cluster described by an Ansible inventory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _site(ctx: typer.Context) -> Site:
    site: Site = ctx.obj
    return site


JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


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
) -> None:
    ctx.obj = Site(inventory, limit, exclude, forks, timeout)


# inventory / health -------------------------------------------------------------------------------
@app.command("inventory")
def inventory_cmd(ctx: typer.Context, json_output: JsonOpt = False) -> None:
    """Show the selected hosts with their connection and bundle variables."""
    with Context(_site(ctx), readonly=True) as session:
        hosts = session.hosts
        source = str(session.inventory.source)
        if json_output:
            groups = session.inventory.groups
            render.emit_json(
                {"source": source, "groups": groups, "hosts": [h.as_dict() for h in hosts]}
            )
        else:
            render.inventory(source, hosts)


@app.command()
def health(
    ctx: typer.Context,
    deep: Annotated[
        bool, typer.Option(help="Also run a real all-reduce across the hosts (slow).")
    ] = False,
    json_output: JsonOpt = False,
) -> None:
    """The pre-launch gate: one round trip per host; exit 1 when a check is CRIT."""
    from rlmctl import health as health_checks
    from rlmctl import lifecycle

    with Context(_site(ctx), readonly=True) as session:
        hosts = session.hosts
        report = health_checks.run_checks(session.fleet)
        lifecycle.backend_for(session).node_checks(report)  # e.g. Slurm's drain/down per node
        deep_result = None
        if deep:
            from rlmctl import deep as deep_checks

            healthy = [h for h in hosts if h.name in report.healthy]
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
    """The go-live verdict of a run: every criterion with threshold, measured value, PASS/FAIL/
    NO DATA/N/A and source; writes <run_dir>/acceptance.md with plots. Exit 1 when one FAILs."""
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
    json_output: JsonOpt = False,
) -> None:
    """Check the config and its memory estimate, gate, create the run directory, and start
    torchrun on every host (detached), or submit the batch job to Slurm (rlm_scheduler: slurm)."""
    from rlmctl import lifecycle
    from rlmctl.backend import LaunchRequest

    for text in overrides or []:
        if "=" not in text:
            raise RlmctlError(f"override {text!r} must look like key=value, e.g. train.steps=500")
    request = LaunchRequest(
        config, overrides or [], name, nodes, force, partition, time_limit, memory_check
    )
    with Context(_site(ctx)) as session:
        backend = lifecycle.backend_for(session)
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
) -> None:
    """Print the launcher logs (torchrun + trainer output) from the run directory."""
    from rlmctl import lifecycle
    from rlmctl import logs as run_logs

    with Context(_site(ctx), readonly=True) as session:
        paths = lifecycle.log_paths(session, lifecycle.backend_for(session), run, host)
    run_logs.show(paths, lines, follow, sys.stdout)


@app.command()
def stop(
    ctx: typer.Context,
    run: str,
    timeout: Annotated[
        float, typer.Option(help="Seconds between SIGTERM (checkpoint and exit) and SIGKILL.")
    ] = 60.0,
    json_output: JsonOpt = False,
) -> None:
    """Stop a run on every host; verifies that none of its processes remain. A run that has
    already ended is left as it is."""
    from rlmctl import lifecycle

    with Context(_site(ctx)) as session:
        outcome = lifecycle.stop(session, lifecycle.backend_for(session), run, timeout)
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
) -> None:
    """Relaunch a stopped or failed run from its newest verified checkpoint."""
    from rlmctl import lifecycle

    site = _site(ctx)
    with Context(site) as session:
        excluded = set()
        if site.exclude:
            excluded = {h.name for h in session.inventory.select(site.exclude)}
        backend = lifecycle.backend_for(session)
        resumed = lifecycle.resume(session, backend, run, excluded, force, render.say())
    if resumed.job_id:
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
    )
    with Context(_site(ctx)) as session:
        backend = lifecycle.backend_for(session)
        code = lifecycle.watch(session, backend, run, policy, render.say())
    raise typer.Exit(code)


# registry views -----------------------------------------------------------------------------------
@app.command()
def runs(ctx: typer.Context, json_output: JsonOpt = False) -> None:
    """Runs in the registry, oldest first, with their state from their run directories."""
    from rlmctl import lifecycle

    try:
        with Context(_site(ctx), readonly=True) as session:
            rows = lifecycle.summaries(session)
    except RunNotFound:  # no registry yet
        rows = []
    if json_output:
        render.emit_json(rows)
    else:
        render.runs(rows)


@app.command()
def reindex(ctx: typer.Context) -> None:
    """Rebuild the registry (an index) from the run directories under rlm_shared_dir/runs."""
    from rlmctl.registry import reindex as rebuild

    with Context(_site(ctx)) as session:
        added = rebuild(session.registry, session.runs_root)
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
    from rlmctl.lifecycle import checkpoint_row

    with Context(_site(ctx), readonly=True) as session:
        run_dir = session.run(run)
    rows = [checkpoint_row(info) for info in run_dir.checkpoints(full=verify)]
    if json_output:
        render.emit_json(rows)
    else:
        render.checkpoints(run, rows, verify)
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
    nodes: Annotated[int, typer.Option(help="Nodes to allocate.")] = 2,
    gpus_per_node: Annotated[int | None, typer.Option(help="Default: rlm_gpus_per_node.")] = None,
    partition: Annotated[str | None, typer.Option(help="Slurm partition.")] = None,
    time_limit: Annotated[str, typer.Option("--time", help="Slurm time limit.")] = "24:00:00",
    name: Annotated[str | None, typer.Option(help="Run name (default: config stem).")] = None,
) -> None:
    """Print an sbatch script (srun + torchrun) for sites that schedule with Slurm."""
    from rlmctl import slurm as slurm_script

    with Context(_site(ctx), readonly=True) as session:
        host = session.hosts[0]
    print(
        slurm_script.render(
            config=config,
            name=name or config.stem,
            nodes=nodes,
            gpus_per_node=gpus_per_node or host.gpus_per_node,
            partition=partition,
            time_limit=time_limit,
            host=host,
        ),
        end="",
    )


@app.command()
def demo(
    ctx: typer.Context,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 300,
) -> None:
    """The whole flow on this machine: prepare data, gate, launch 2 CPU workers, stop, report."""
    from rlmctl import demo as demo_flow

    with Context(_site(ctx)) as session:
        code = demo_flow.run(session, steps)
    raise typer.Exit(code)


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


def hoist_global_options(argv: list[str]) -> list[str]:
    """Move global options written after the command in front of it (`rlmctl health --limit x`),
    unless the command has an option of that name itself (`stop --timeout`)."""
    group = typer.main.get_command(app)
    command_index = next((i for i, word in enumerate(argv) if word in group.commands), None)  # type: ignore[attr-defined]
    if command_index is None:
        return argv
    command = group.commands[argv[command_index]]  # type: ignore[attr-defined]
    own = {opt for p in command.params if p.param_type_name == "option" for opt in p.opts}
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
        app(args=args, prog_name="rlmctl")
    except (RlmctlError, InventoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)

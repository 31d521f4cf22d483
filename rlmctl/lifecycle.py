"""The run lifecycle, written once for every backend (rlmctl.backend.Backend: SSH, Slurm).

A launch, step by step (`LaunchStep`): the run's name (checked, free) → the config (the trainer's
own parser, `runcontract.config`, for the world size asked for) and its memory estimate against
the GPUs (`rlmctl plan`) → the cluster's yes (the SSH health gate, `sbatch --test-only`) → the run
directory created exclusively (mkdir) with the effective config, indexed in the registry → the
attempt recorded (`launched`, and where it will run) before anything starts → the backend starts
it → the registry records what started. A launch interrupted at any step (Ctrl-C) or failing
stops what it started and either removes the run (nothing of a trainer ever ran: the name is
free), or keeps it resumable (`launch_failed`: the run is `failed`, resume it), and says which.

status, stop, resume (with refuse-done and the checkpoint it resumes from) and watch (fail fast,
the one exit-code ranking, restart budget and back-off) are here too; the backend only starts,
probes and signals. State changes are events in the run directory; the registry holds no state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from pathlib import Path
from typing import Any

from rlmctl import goodput, plan
from rlmctl.backend import Attempt, Backend, LaunchRequest, Placement, Probe, Say, Started, quiet
from rlmctl.context import Context
from rlmctl.errors import GateRefused, RlmctlError
from rlmctl.records import (
    CheckpointRow,
    DryRun,
    HostStop,
    Launched,
    RunStatus,
    RunSummary,
    StopResult,
)
from rlmctl.registry import registry_path
from runcontract.config import Config, check_world_size, dump_yaml, load_config, validate
from runcontract.errors import UserError
from runcontract.exitcodes import restartable
from runcontract.interval import IntervalChoice
from runcontract.records import Event
from runcontract.rundir import (
    MANIFEST_NAME,
    CheckpointInfo,
    RunDir,
    check_run_name,
    verify_checkpoint,
)
from runcontract.states import EventKind, RunState
from runcontract.stragglers import DEFAULT_MARGIN as STRAGGLER_MARGIN
from runcontract.stragglers import DEFAULT_WINDOWS as STRAGGLER_WINDOWS


def backend_for(ctx: Context) -> Backend:
    """The backend that `rlm_scheduler` of the selected hosts names: rlmctl/backend_<name>.py."""
    kinds = {h.scheduler for h in ctx.hosts}
    if len(kinds) > 1:
        raise RlmctlError(
            f"selected hosts disagree on rlm_scheduler ({', '.join(sorted(kinds))}); "
            "set it once for the whole group in the inventory"
        )
    module = importlib.import_module(f"rlmctl.backend_{kinds.pop()}")
    backend: Backend = module.Backend(ctx)
    return backend


# name and config ----------------------------------------------------------------------------------
def run_name(config_file: Path, name: str | None) -> str:
    """The run's name (default: config stem + time), checked; the config file must exist."""
    if not Path(config_file).is_file():
        raise RlmctlError(f"config file {config_file} does not exist; pass --config FILE")
    if name is None:
        name = f"{Path(config_file).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    problem = check_run_name(name)
    if problem:
        raise RlmctlError(f"{problem}; pass another --name")
    return name


def resolve_config(config_file: Path, overrides: list[str], run_dir: Path, world: int) -> Config:
    """The trainer's own parsing and validation (runcontract.config, torch-free) for `world`
    workers, with run_dir set to the run's directory."""
    try:
        cfg = load_config(config_file, [*overrides, f"run_dir={run_dir}"])
        validate(cfg)
        check_world_size(cfg, world)
    except UserError as error:
        raise RlmctlError(f"{config_file}: {error}") from None
    return cfg


def check_memory(cfg: Config, placement: Placement, config_file: Path) -> None:
    """Refuse a config whose memory estimate per GPU (rlmctl plan) exceeds the GPUs' memory
    (rlm_gpu_memory_gib), naming a layout that fits; hosts without that fact are not judged."""
    memory = placement.gpu_memory_gib
    if memory is None or placement.template.gpu_vendor == "none":
        return
    fit = plan.config_fit(cfg, placement.world_size, placement.gpus_per_node, memory)
    if fit.problem:
        raise RlmctlError(f"{config_file}: {fit.problem}; or launch anyway with --no-memory-check")


def refuse_existing(ctx: Context, run: RunDir) -> None:
    """A cheap early answer that writes nothing (no registry is created for it); the exclusive
    create in `claim_run` is what decides."""
    indexed = registry_path(ctx.runs_root).is_file() and any(
        r["name"] == run.name for r in ctx.registry.runs()
    )
    if run.path.exists() or indexed:
        raise _exists(run)


def _exists(run: RunDir) -> RlmctlError:
    return RlmctlError(
        f"run {run.name!r} already exists ({run.path}); pick another --name or "
        f"`rlmctl resume {run.name}`"
    )


def claim_run(ctx: Context, run: RunDir, config_text: str) -> None:
    """Create the run directory exclusively with its config, then index it."""
    record: dict[str, Any] = {
        "inventory": str(ctx.inventory.source),
        "created": time.time(),
        "by": "rlmctl launch",
    }
    try:
        run.create_exclusive(config_text, record)
    except FileExistsError:
        raise _exists(run) from None
    except OSError as error:
        raise RlmctlError(f"cannot create the run directory {run.path}: {error.strerror}") from None
    try:
        ctx.registry.add_run(run.name, str(run.path), str(ctx.inventory.source), record["created"])
    except BaseException:
        run.discard()
        raise


# launch -------------------------------------------------------------------------------------------
class LaunchStep(Enum):
    """The steps of a launch, in order; an interruption at any of them is safe."""

    NAME = auto()  # check the name and that it is free
    CONFIG = auto()  # resolve and validate the config, check its memory estimate
    ADMIT = auto()  # the health gate / sbatch --test-only
    CLAIM = auto()  # create the run directory and index it
    RECORD = auto()  # record the attempt (`launched`) and where it goes, before it starts
    START = auto()  # the backend starts it
    STARTED = auto()  # it started; the registry records what
    DONE = auto()  # launched


class Progress:
    """How far a launch or resume got, and what an interruption there leaves (`outcome`)."""

    def __init__(self, on_step: Callable[[LaunchStep], None] | None = None) -> None:
        self.on_step = on_step
        self.outcome = "nothing was created; the run name is free"

    def at(self, step: LaunchStep) -> None:
        if self.on_step is not None:
            self.on_step(step)


def launch(
    ctx: Context,
    backend: Backend,
    request: LaunchRequest,
    say: Say = quiet,
    on_step: Callable[[LaunchStep], None] | None = None,
) -> Launched:
    """Create the run and start its first attempt (see the module's docstring)."""
    progress = Progress(on_step)
    try:
        return _launch(ctx, backend, request, say, progress)
    except KeyboardInterrupt:
        say(f"interrupted: {progress.outcome}")
        raise


def _launch(
    ctx: Context, backend: Backend, request: LaunchRequest, say: Say, progress: Progress
) -> Launched:
    progress.at(LaunchStep.NAME)
    name = run_name(request.config, request.name)
    run = RunDir(ctx.runs_root / name)
    refuse_existing(ctx, run)
    progress.outcome = f"nothing was created; the name {name} is free"
    progress.at(LaunchStep.CONFIG)
    placement = backend.placement(request)
    # Validate before touching any host: a bad config must not cost a health round trip.
    cfg = resolve_config(request.config, request.overrides, run.path, placement.world_size)
    if request.memory_check:
        check_memory(cfg, placement, request.config)
    progress.at(LaunchStep.ADMIT)
    attempt = Attempt("launch")
    admitted = backend.admit(run, placement, attempt, say)
    if admitted.world_size != placement.world_size or admitted.hosts != placement.hosts:
        cfg = resolve_config(request.config, request.overrides, run.path, admitted.world_size)
        if request.memory_check:
            check_memory(cfg, admitted, request.config)
    progress.at(LaunchStep.CLAIM)
    claim_run(ctx, run, dump_yaml(cfg))
    started = start_attempt(ctx, backend, run, admitted, attempt, say, progress)
    progress.outcome = f"run {name} was launched and goes on (rlmctl status {name})"
    progress.at(LaunchStep.DONE)
    return Launched(
        name, str(run.path), started.hosts, started.rdzv_endpoint, job_id=started.job_id
    )


def plan_launch(ctx: Context, backend: Backend, request: LaunchRequest) -> DryRun:
    """`launch --dry-run` (and `rlmctl slurm`): the name and config steps of a launch, then what
    it would start on the selected hosts, or the batch script it would submit; nothing is
    written, no host is contacted. The health gate (SSH) or `sbatch --test-only` (Slurm) is not
    asked: a host it refuses is not started (`--force`: started last)."""
    name = run_name(request.config, request.name)
    run = RunDir(ctx.runs_root / name)
    refuse_existing(ctx, run)
    placement = backend.placement(request)
    cfg = resolve_config(request.config, request.overrides, run.path, placement.world_size)
    if request.memory_check:
        check_memory(cfg, placement, request.config)
    notes = [
        f"the run directory {run.path} would be created with the config as {run.config_path}",
        "not asked: the health gate (SSH) or sbatch --test-only (Slurm)",
    ]
    commands = backend.commands(run, placement, Attempt("launch"))
    return DryRun(name, str(run.path), "launch", commands, notes)


def start_attempt(
    ctx: Context,
    backend: Backend,
    run: RunDir,
    placement: Placement,
    attempt: Attempt,
    say: Say,
    progress: Progress,
) -> Started:
    """Record the attempt, start it, record what started; all or nothing (`undo_attempt`)."""
    try:
        say(f"run {run.name}: {run.path}")
        progress.at(LaunchStep.RECORD)
        hosts = [h.name for h in placement.hosts]  # none where a scheduler picks the nodes
        run.record(EventKind.LAUNCHED, launch=attempt.kind, hosts=hosts, nodes=placement.nodes)
        intended = [{"host": h.name, "address": h.address} for h in placement.hosts]
        launch_id = ctx.registry.record_launch(run.name, attempt.kind, intended, "", "")
        progress.at(LaunchStep.START)
        started = backend.start(run, placement, attempt, say)
        progress.at(LaunchStep.STARTED)
        ctx.registry.complete_launch(
            launch_id, started.processes, started.rdzv_id, started.rdzv_endpoint
        )
        if started.failures and not started.hosts:
            raise GateRefused(f"could not start on any host: {'; '.join(started.failures)}")
        if started.failures:
            raise GateRefused(
                f"could not start on {len(started.failures)} host(s): "
                + "; ".join(started.failures)
            )
        return started
    except BaseException as error:
        progress.outcome = undo_attempt(ctx, backend, run, attempt, error)
        raise


def undo_attempt(
    ctx: Context, backend: Backend, run: RunDir, attempt: Attempt, error: BaseException
) -> str:
    """After an attempt failed or was interrupted while it started: stop whatever of it started;
    a launch whose trainer never began is removed (the name is free again), anything else is
    kept resumable (`launch_failed`). What is left, in words."""
    try:
        cleaned = backend.abandon(run)
    except Exception:  # an unreachable host or scheduler: keep the run, say so
        cleaned = False
    began = any(e.kind == EventKind.START for e in run.events()) or bool(run.checkpoints())
    if attempt.kind == "launch" and cleaned and not began:
        with contextlib.suppress(Exception):
            ctx.registry.remove_run(run.name)
        run.discard()
        return f"nothing of run {run.name} is left; the name is free again"
    reason = "interrupted" if isinstance(error, KeyboardInterrupt) else str(error)
    with contextlib.suppress(Exception):
        run.record(EventKind.LAUNCH_FAILED, reason=reason)
    if cleaned:
        return f"run {run.name} is kept and nothing of it runs: rlmctl resume {run.name}"
    return (
        f"run {run.name} is kept but may still have processes: rlmctl stop {run.name}, then "
        f"rlmctl resume {run.name}"
    )


# look ---------------------------------------------------------------------------------------------
def status(ctx: Context, backend: Backend, name: str) -> RunStatus:
    """The run's state of record with what its processes or its job say; reads only."""
    run = ctx.run(name)
    probe = backend.probe(run)
    state = run.state()
    problem = None
    if probe.unreachable:
        problem = f"no answer from {', '.join(probe.unreachable)}"
    elif state is not None and state.active and not probe.complete:
        problem = (
            f"recorded {state.value} but {probe.not_running}; see `rlmctl logs {name}`, then "
            f"{probe.recovery}"
        )
    elif state is not None and not state.active and probe.executing:
        problem = f"recorded {state.value} but {probe.still_running}"
    return RunStatus(
        run=name,
        state=state,
        run_dir=str(run.path),
        hosts=probe.hosts,
        problem=problem,
        **progress_fields(run),
        slurm=probe.job,
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
        "goodput": goodput.run_view(run, STRAGGLER_MARGIN, STRAGGLER_WINDOWS),
    }


def summaries(ctx: Context) -> list[RunSummary]:
    """Every indexed run with its state and restarts read from its run directory."""
    out = []
    for row in ctx.registry.runs():
        run = RunDir(row["run_dir"])
        out.append(
            RunSummary(
                name=row["name"],
                state=run.state(),
                hosts=[h["host"] for h in ctx.registry.hosts(row["name"])],
                restarts=run.restarts(),
                created=row["created"],
                run_dir=row["run_dir"],
                inventory=row["inventory"],
            )
        )
    return out


def checkpoint_row(info: CheckpointInfo) -> CheckpointRow:
    return CheckpointRow(
        step=info.step,
        path=str(info.path),
        valid=info.valid,
        reason=info.reason,
        size_bytes=info.size_bytes,
        age_s=round(info.age_seconds, 1),
    )


def verify_checkpoints(
    infos: list[CheckpointInfo], done: Callable[[CheckpointInfo], None] | None = None
) -> list[CheckpointInfo]:
    """Each checkpoint verified in full (sizes and sha256, `verify_checkpoint(full=True)`);
    `done(info)` after each (a progress display)."""
    verified = []
    for info in infos:
        verified.append(verify_checkpoint(info.path, full=True) if info.valid else info)
        if done is not None:
            done(info)
    return verified


def log_paths(ctx: Context, backend: Backend, name: str, host: str | None) -> dict[str, Path]:
    return backend.log_paths(ctx.run(name), host)


# stop ---------------------------------------------------------------------------------------------
def stop(
    ctx: Context,
    backend: Backend,
    name: str,
    timeout: float,
    leave_out: frozenset[str] = frozenset(),
) -> StopResult:
    """SIGTERM (the trainer saves a checkpoint and exits 0), kill after `timeout`; per host (or
    job) whether anything is left. A run that has already ended with nothing left to run is not
    touched. `leave_out`: hosts not to contact (unreachable)."""
    run = ctx.run(name)
    state = run.state()
    probe = backend.probe(run)
    if state is not None and not state.active and not probe.alive:
        reason = f"run {name} is already {state.value}; nothing to stop"
        untouched = [HostStop(h.host, True) for h in probe.hosts]
        return StopResult(name, state, untouched, skipped=reason, slurm=probe.job)
    # Before any signal: a concurrent `rlmctl watch` must read the exits as requested.
    run.record(EventKind.STOP_REQUESTED, timeout_s=timeout, **probe.ref)
    outcome = backend.stop(run, probe, timeout, set(leave_out))
    if all(o.ok for o in outcome):
        run.record(EventKind.STOPPED, hosts=[o.host for o in outcome], **probe.ref)
    else:
        run.append_event(EventKind.STOP_FAILED, hosts=[o.host for o in outcome if not o.ok])
    job = backend.probe(run).job if probe.job is not None else None
    return StopResult(name, run.state(), outcome, slurm=job)


def plan_stop(ctx: Context, backend: Backend, name: str, timeout: float) -> DryRun:
    """`stop --dry-run`: what stop would signal now; nothing is recorded or signalled."""
    run = ctx.run(name)
    state = run.state()
    probe = backend.probe(run)
    if state is not None and not state.active and not probe.alive:
        note = f"run {name} is already {state.value}; nothing to stop"
        return DryRun(name, str(run.path), "stop", {}, [note])
    commands = backend.stop_commands(run, probe, timeout, set())
    return DryRun(name, str(run.path), "stop", commands, [f"state of record: {state_name(state)}"])


def state_name(state: RunState | None) -> str:
    return state.value if state is not None else "unknown"


# resume -------------------------------------------------------------------------------------------
def resume_checkpoint(run: RunDir, say: Say) -> CheckpointInfo | None:
    """The newest checkpoint that passes the full (sha256) verification; None to start fresh."""
    for info in reversed(run.checkpoints()):
        if not info.valid:
            say(f"skipping checkpoint {info.path.name}: {info.reason}")
            continue
        full = verify_checkpoint(info.path, full=True)
        if full.valid:
            return full
        say(f"skipping checkpoint {info.path.name}: {full.reason}")
    return None


def resume_from(run: RunDir, say: Say) -> str:
    """The trainer's checkpoint.resume for a resume: the newest verified checkpoint, or `never`
    when there is none yet; refuses when checkpoints exist but none verifies."""
    checkpoint = resume_checkpoint(run, say)
    complete_once = [i for i in run.checkpoints() if (i.path / MANIFEST_NAME).exists()]
    if checkpoint is None and complete_once:
        raise RlmctlError(
            f"none of the {len(complete_once)} checkpoint(s) of run {run.name} verifies (see "
            f"`rlmctl checkpoints {run.name} --verify`); restore them, or move them aside to "
            "start again from step 0"
        )
    if checkpoint is None:
        say("no checkpoint yet: the run starts again from step 0")
        return "never"
    say(f"resuming from {checkpoint.path.name} (step {checkpoint.step}, verified)")
    return str(checkpoint.path)


def refuse_done(run: RunDir) -> None:
    if run.state() is RunState.DONE:
        step = run.status().step
        raise RlmctlError(
            f"run {run.name} is done (step {step}); nothing to resume. To train further, launch "
            f"a new run from its checkpoint: checkpoint.resume={run.checkpoints_dir}/step-..."
        )


def resume(
    ctx: Context,
    backend: Backend,
    name: str,
    exclude: set[str],
    force: bool = False,
    say: Say = quiet,
    site: dict[str, str] | None = None,
) -> Launched:
    """Relaunch a stopped or failed run in its own run directory from its newest verified
    checkpoint, on what it ran on before less `exclude` (the same global batch: the trainer's
    world-size check says whether it still divides). `site`: Slurm site options (account, qos,
    reservation, constraint) replacing the ones it was launched with."""
    run, attempt, wanted = resume_request(ctx, backend, name, exclude, force, say, site)
    placement = backend.admit(run, wanted, attempt, say)
    resolve_config(run.config_path, [], run.path, placement.world_size)
    started = start_attempt(ctx, backend, run, placement, attempt, say, Progress())
    return Launched(
        name, str(run.path), started.hosts, started.rdzv_endpoint, "resume", started.job_id
    )


def plan_resume(
    ctx: Context,
    backend: Backend,
    name: str,
    exclude: set[str],
    say: Say = quiet,
    site: dict[str, str] | None = None,
) -> DryRun:
    """`resume --dry-run`: the checks and the checkpoint of a resume, then what it would start;
    nothing is written or started, the gate is not asked."""
    run, attempt, wanted = resume_request(ctx, backend, name, exclude, False, say, site)
    resolve_config(run.config_path, [], run.path, wanted.world_size)
    notes = [
        f"from checkpoint.resume={attempt.resume_from}",
        "not asked: the health gate (SSH: a host that fails it is left out) or Slurm",
    ]
    return DryRun(name, str(run.path), "resume", backend.commands(run, wanted, attempt), notes)


def resume_request(
    ctx: Context,
    backend: Backend,
    name: str,
    exclude: set[str],
    force: bool,
    say: Say,
    site: dict[str, str] | None = None,
) -> tuple[RunDir, Attempt, Placement]:
    """What every resume checks first (not done, not alive, a verified checkpoint or none at
    all) and where it asks to run."""
    run = ctx.run(name)
    refuse_done(run)
    probe = backend.probe(run)
    if probe.alive:
        raise RlmctlError(
            f"run {name} is still running ({probe.still_running}); stop it first: "
            f"rlmctl stop {name}"
        )
    attempt = Attempt("resume", resume_from(run, say), tuple(goodput.current_overrides(run)))
    wanted = dataclasses.replace(backend.placement_of(run, exclude), force=force)
    if site:
        if wanted.template.scheduler != "slurm":
            flags = " ".join(f"--{key}" for key in site)
            raise RlmctlError(f"{flags}: Slurm options, but run {name} runs over SSH; drop them")
        wanted = dataclasses.replace(wanted, site={**wanted.site, **site})
        from rlmctl.slurm import SiteOptions

        SiteOptions.of(wanted.template, wanted.site)
    return run, attempt, wanted


# watch --------------------------------------------------------------------------------------------
@dataclass
class WatchPolicy:
    poll_s: float = 5.0
    stall_s: float = 300.0  # no new step for this long counts as a hang; above start-up time
    max_restarts: int = 3
    backoff_s: float = 10.0  # before the first restart; doubles after each
    stop_timeout_s: float = 60.0
    # On a restart: `auto` sets checkpoint.interval_steps from the measured failure rate and
    # checkpoint stall (Young/Daly, rlmctl.goodput.auto_interval), at most `max_interval` steps.
    checkpoint_interval: str = "keep"
    max_interval: int | None = None  # None: the seed's 1000 (never beyond the go-live limit)
    # On a restart: leave out the hosts of persistent stragglers (runcontract.stragglers).
    exclude_stragglers: bool = False
    straggler_margin: float = STRAGGLER_MARGIN
    straggler_windows: int = STRAGGLER_WINDOWS
    # A host named by this many failed attempts of the run stays out for the rest of it; one
    # named fewer times comes back once the scheduler has it in service again (`readmit`).
    strikes: int = 2

    def backoff(self, streak: int) -> float:
        """Seconds before a restart after `streak` earlier failures in a row that kept no new
        checkpoint: give a flapping host, node or filesystem time to recover."""
        return self.backoff_s * 2**streak


@dataclass(frozen=True)
class Failure:
    reason: str
    exit_code: int | None  # None: not the trainer's (a hang, a lost host, a preemption)
    probe: Probe
    preempted: bool = False  # saved and stopped on a signal rlmctl did not send


def watch(ctx: Context, backend: Backend, name: str, policy: WatchPolicy, say: Say) -> int:
    """Supervise until the run is done or stopped (0) or cannot be restarted (1). On a failure
    the rest of the attempt is stopped (survivors would hang in collectives), the exit code
    decides (`runcontract.exitcodes.restartable`), and the run is resumed without the hosts the
    failure names, after the back-off, within the restart budget. Every decision is an event."""
    run = ctx.run(name)
    restarts = 0
    streak = 0  # failures in a row that saved no new checkpoint: the back-off's exponent
    excluded = excluded_hosts(run)
    while True:
        saved_before = newest_checkpoint_step(run)
        failure = follow(backend, run, policy, say)
        if failure is None:
            return 0
        bad = backend.failed_hosts(run, failure.probe)
        reason = failure.reason
        if bad and not failure.probe.unreachable:
            reason += f" (failed on {', '.join(bad)})"
        run.append_event(
            EventKind.FAILURE,
            reason=reason,
            exit_code=failure.exit_code,
            step=run.status().step,
            nodes=bad,
            preempted=failure.preempted,
            **failure.probe.ref,
        )
        say(f"failure: {reason}; stopping the rest of the job")
        stop(ctx, backend, name, policy.stop_timeout_s, frozenset(failure.probe.unreachable))
        code = failure.exit_code
        if not restartable(code):
            return give_up(
                run, f"exit code {code} is not restartable (see rlmctl logs {name})", say
            )
        if restarts >= policy.max_restarts:
            return give_up(run, f"restart budget of {policy.max_restarts} used up", say)
        new = sorted(set(bad) - excluded)
        if new:
            excluded |= set(new)
            run.append_event(EventKind.EXCLUDED, hosts=new, reason=reason)
        if policy.exclude_stragglers:
            excluded |= exclude_stragglers(ctx, backend, run, excluded, policy, say)
        excluded -= readmit(backend, run, excluded - set(bad), policy, say)
        if policy.checkpoint_interval != "keep":
            choose_checkpoint_interval(ctx, run, policy, say)
        # A month-long run fails many times; only a flapping one (no progress kept between
        # failures) should wait longer and longer.
        if newest_checkpoint_step(run) > saved_before:
            streak = 0
        delay = policy.backoff(streak)
        streak += 1
        restarts += 1
        say(f"restart {restarts}/{policy.max_restarts} in {delay:g} s (exit code {code})")
        time.sleep(delay)  # the back-off policy, not a synchronisation
        try:
            resumed = resume(ctx, backend, name, excluded, say=say)
        except RlmctlError as error:  # no healthy hosts, batch no longer divides, ...
            return give_up(run, str(error), say)
        if resumed.job_id:
            say(f"resubmitted as Slurm job {resumed.job_id}, excluding "
                f"{', '.join(sorted(excluded)) or '-'}")  # fmt: skip


def excluded_hosts(run: RunDir) -> set[str]:
    """The hosts left out of the run's next attempt: its `excluded` events' hosts, less those
    `readmitted` since."""
    out: set[str] = set()
    for event in run.events():
        if event.kind == EventKind.EXCLUDED:
            out |= set(event.fields.get("hosts", []))
        elif event.kind == EventKind.READMITTED:
            out -= set(event.fields.get("hosts", []))
    return out


def readmit(
    backend: Backend, run: RunDir, candidates: set[str], policy: WatchPolicy, say: Say
) -> set[str]:
    """The excluded `candidates` the next attempt may have again (a `readmitted` event): in
    service by the backend's word (Slurm's health check drains a node that fails it), named by
    fewer than `policy.strikes` failures of the run, and not left out as a straggler (slow
    hardware passes health checks). The caller leaves out the hosts of the failure at hand:
    a host sits out at least one attempt, time for the scheduler's next health check. Without
    this, every node that ever failed a month-long run would be lost to it for good."""
    events = run.events()
    strikes: dict[str, int] = {}
    for event in events:
        if event.kind == EventKind.FAILURE:
            for host in event.fields.get("nodes") or []:
                strikes[host] = strikes.get(host, 0) + 1
    slow = {
        host
        for event in events
        if event.kind == EventKind.EXCLUDED and event.fields.get("stragglers")
        for host in event.fields.get("hosts", [])
    }
    eligible = sorted(h for h in candidates - slow if strikes.get(h, 0) < policy.strikes)
    try:
        back = backend.in_service(eligible) if eligible else {}
    except RlmctlError as error:  # the scheduler did not answer: they stay out this time
        say(f"no host readmitted: {error}")
        return set()
    if not back:
        return set()
    hosts = sorted(back)
    reason = "; ".join(
        f"{h}: {back[h]}, strike {strikes.get(h, 0)} of {policy.strikes}" for h in hosts
    )
    run.append_event(
        EventKind.READMITTED,
        hosts=hosts,
        reason=reason,
        strikes={h: strikes.get(h, 0) for h in hosts},
    )
    say(f"readmitting {', '.join(hosts)} ({reason})")
    return set(hosts)


def newest_checkpoint_step(run: RunDir) -> int:
    newest = run.latest_valid_checkpoint()
    return newest.step if newest else -1


def exclude_stragglers(
    ctx: Context, backend: Backend, run: RunDir, excluded: set[str], policy: WatchPolicy, say: Say
) -> set[str]:
    """The hosts of the failed attempt's persistent stragglers, left out of the next attempt
    like failed hosts (an `excluded` event) when the rest still divides the global batch."""
    found = goodput.straggler_exclusions(run, policy.straggler_margin, policy.straggler_windows)
    hosts = sorted({s.host for s in found} - excluded)
    if not hosts:
        return set()
    why = "; ".join(s.describe() for s in found if s.host in hosts)
    try:
        left = backend.placement_of(run, excluded | set(hosts))
        resolve_config(run.config_path, goodput.current_overrides(run), run.path, left.world_size)
    except RlmctlError as error:
        say(f"straggler kept: {why}; without it the job cannot run ({error})")
        return set()
    run.append_event(
        EventKind.EXCLUDED,
        hosts=hosts,
        reason=f"straggler: {why}",
        stragglers=[dataclasses.asdict(s) for s in found if s.host in hosts],
    )
    say(f"excluding straggler host(s) {', '.join(hosts)}: {why}")
    return set(hosts)


def choose_checkpoint_interval(ctx: Context, run: RunDir, policy: WatchPolicy, say: Say) -> None:
    """`--checkpoint-interval auto`: the interval of the next attempts from the failures seen
    (this run and the registry's runs) and this run's checkpoint stall, recorded as an event
    that every later resume of the run applies."""
    thresholds = ctx.hosts[0].accept_thresholds if ctx.hosts else None
    cap = goodput.interval_cap(policy.max_interval, thresholds)
    history = [RunDir(row["run_dir"]) for row in ctx.registry.runs()]
    choice, seen = goodput.auto_interval(run, history, cap)
    if policy.checkpoint_interval != "auto":
        steps = int(policy.checkpoint_interval)
        choice = IntervalChoice(steps, f"set by --checkpoint-interval {steps}")
    previous = goodput.measured(run).interval_steps
    goodput.record_choice(run, choice, seen, previous)
    if choice.steps is None:
        say(f"checkpoint interval: {choice.reason}")
    else:
        say(f"checkpoint interval: {previous} -> {choice.steps} steps ({choice.reason})")


def follow(backend: Backend, run: RunDir, policy: WatchPolicy, say: Say) -> Failure | None:
    """Poll the newest attempt until it ends: None when it finished cleanly or was stopped
    (rlmctl stop), else the failure. The exit code is read before the rest is stopped: the
    survivors would exit 0 on SIGTERM and hide the crash."""
    last_step: int | None = None
    last_change = time.monotonic()
    while True:
        backend.tend(run, say)
        probe = backend.probe(run)
        events = run.events()
        since = max((e.time for e in events if e.kind == EventKind.LAUNCHED), default=0.0)
        if any(e.kind == EventKind.STOP_REQUESTED and e.time >= since for e in events):
            say(f"run {run.name} was stopped (rlmctl stop)")
            return None
        if probe.unreachable:
            hosts = ", ".join(sorted(probe.unreachable))
            return Failure(f"host(s) {hosts} unreachable", None, probe)
        status = run.status()
        if not probe.running:
            if run.state() is RunState.DONE:
                say(f"run {run.name} done at step {status.step}")
                return None
            if (status.updated or 0.0) >= since and status.stopped_before_end:
                # Saved and exited on a signal rlmctl did not send (preemption): resume it.
                reason = f"trainer stopped on a signal at step {status.step} (preempted)"
                return Failure(reason, None, probe, preempted=True)
            return Failure(probe.ended, run.attempt_exit_code(), probe)
        # A host whose ranks all finished leaves before rank 0 has written the last checkpoint
        # and said done: only a host that ended otherwise is a failure. Should the rest then
        # hang, the stall clock below catches it. The exit records are read only then: most
        # polls have no host gone.
        failed = sorted(set(probe.gone) - finished_hosts(run, events)) if probe.gone else []
        if failed:
            gone = ", ".join(failed)
            return Failure(f"trainer process gone on {gone}", run.attempt_exit_code(), probe)
        if status.step != last_step or not probe.executing:  # pending or requeued: no clock
            if status.step != last_step and last_step is not None:
                say(f"step {status.step} loss {status.loss}")
            last_step, last_change = status.step, time.monotonic()
        elif time.monotonic() - last_change > policy.stall_s:
            stuck = f"no step progress for {policy.stall_s:g} s (stuck at step {status.step})"
            return Failure(stuck, None, probe)
        time.sleep(policy.poll_s)  # the supervisor's polling interval, not a synchronisation


def finished_hosts(run: RunDir, events: list[Event]) -> set[str]:
    """The hosts whose launcher ended this attempt with 0, torchrun's and the attempt's code
    alike: their ranks reached the end (a crash elsewhere would have made either non-zero)."""
    records = run.exit_records(run.attempt_since(events))
    return {
        host
        for host, record in records.items()
        if record["exit_code"] == 0 and record.get("launcher_exit_code", 0) == 0
    }


def give_up(run: RunDir, message: str, say: Say) -> int:
    run.record(EventKind.GAVE_UP, reason=message)
    say(f"giving up: {message}")
    return 1

"""Resume a run from its newest good checkpoint, and supervise a run (`rlmctl watch`).

Failure handling is fail-fast and whole-job: when one host's trainer dies, a host stops answering,
or the step counter stops moving, the rest of the job is stopped (its collectives would only hang)
and the exit code decides whether a restart can help (runcontract.exitcodes.restartable). A
restart is a resume: verify the checkpoint, re-run the gate, leave out hosts that fail it (fewer
nodes, same global batch), relaunch. Every decision is an event in the run directory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from clusterspec.inventory import Inventory
from rlmctl import launch
from rlmctl.errors import RlmctlError
from rlmctl.launch import GateRefused, Say, Started
from rlmctl.registry import Registry
from rlmctl.remote import Fleet
from runcontract.records import stopped_before_end
from runcontract.rundir import MANIFEST_NAME, CheckpointInfo, RunDir, verify_checkpoint
from runcontract.states import RunState


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


def resume_from(run: RunDir, name: str, say: Say) -> str:
    """The trainer's checkpoint.resume for a resume: the newest verified checkpoint, or `never`
    when there is none yet; refuses when checkpoints exist but none verifies."""
    checkpoint = resume_checkpoint(run, say)
    complete_once = [i for i in run.checkpoints() if (i.path / MANIFEST_NAME).exists()]
    if checkpoint is None and complete_once:
        raise RlmctlError(
            f"none of the {len(complete_once)} checkpoint(s) of run {name} verifies (see "
            f"`rlmctl checkpoints {name} --verify`); restore them, or move them aside to start "
            "again from step 0"
        )
    if checkpoint is None:
        say("no checkpoint yet: the run starts again from step 0")
        return "never"
    say(f"resuming from {checkpoint.path.name} (step {checkpoint.step}, verified)")
    return str(checkpoint.path)


def refuse_done(run: RunDir, name: str) -> None:
    if run.state() is RunState.DONE:
        step = run.status().step
        raise RlmctlError(
            f"run {name} is done (step {step}); nothing to resume. To train further, launch a "
            f"new run from its checkpoint: checkpoint.resume={run.checkpoints_dir}/step-..."
        )


def resume(
    fleet: Fleet,
    inventory: Inventory,
    registry: Registry,
    name: str,
    exclude: set[str],
    say: Say,
    force: bool = False,
) -> Started:
    run, hosts = launch.run_hosts(inventory, registry, name)
    alive = [h for h, p in launch.processes(fleet, registry, name, run, hosts).items() if p.alive]
    refuse_done(run, name)
    if alive:
        raise RlmctlError(
            f"run {name} is still running on {', '.join(alive)}; stop it first: rlmctl stop {name}"
        )
    hosts = [h for h in hosts if h.name not in exclude]
    if not hosts:
        raise GateRefused(f"no hosts left for run {name} after excluding {', '.join(exclude)}")
    overrides = [f"checkpoint.resume={resume_from(run, name, say)}"]
    healthy, report = launch.gate(fleet, hosts, force=True, say=say)
    dropped = [h.host for h in report.failed]
    if not force:
        healthy = [h for h in healthy if h.name not in dropped]
        if dropped:
            say(
                f"leaving out {', '.join(dropped)} (failed the gate); {len(healthy)} host(s) remain"
            )
            run.append_event("excluded", hosts=dropped, reason="failed the health gate")
    if not healthy:
        raise GateRefused(f"every host of run {name} failed the gate; see rlmctl health")
    # Same global batch on fewer hosts: the trainer's check says whether it still divides.
    launch.resolve_config(run.config_path, [], run.path, launch.world_size(healthy))
    return launch.start(fleet, registry, name, run, healthy, "resume", say, overrides)


@dataclass
class WatchPolicy:
    poll_s: float = 5.0
    stall_s: float = 300.0  # no new step for this long counts as a hang; above start-up time
    max_restarts: int = 3
    backoff_s: float = 10.0  # doubles after each restart
    stop_timeout_s: float = 60.0


def watch(
    fleet: Fleet,
    inventory: Inventory,
    registry: Registry,
    name: str,
    policy: WatchPolicy,
    say: Say,
) -> int:
    """Supervise until the run finishes (0) or cannot be restarted (1)."""
    restarts = 0
    while True:
        failure, unreachable, code = _watch_once(fleet, inventory, registry, name, policy, say)
        if failure is None:
            return 0
        run, hosts = launch.run_hosts(inventory, registry, name)
        step = run.status().step
        run.append_event(
            "failure", reason=failure, exit_code=code, step=step, unreachable=sorted(unreachable)
        )
        say(f"failure: {failure}; stopping the rest of the job")
        reachable = [h for h in hosts if h.name not in unreachable]
        launch.stop(fleet, registry, name, policy.stop_timeout_s, hosts=reachable)
        if not launch.restartable(code):
            message = f"exit code {code} is not restartable (see rlmctl logs {name})"
            run.record("gave_up", reason=message)
            say(f"giving up: {message}")
            return 1
        if restarts >= policy.max_restarts:
            message = f"restart budget of {policy.max_restarts} used up"
            run.record("gave_up", reason=message)
            say(f"giving up: {message}")
            return 1
        delay = policy.backoff_s * 2**restarts
        restarts += 1
        say(f"restart {restarts}/{policy.max_restarts} in {delay:g} s (exit code {code})")
        time.sleep(delay)  # back-off policy: give a flapping host or filesystem time to recover
        try:
            resume(fleet, inventory, registry, name, set(unreachable), say)
        except RlmctlError as error:  # no healthy hosts, batch no longer divides, ...
            run.record("gave_up", reason=str(error))
            say(f"giving up: {error}")
            return 1


def _watch_once(
    fleet: Fleet,
    inventory: Inventory,
    registry: Registry,
    name: str,
    policy: WatchPolicy,
    say: Say,
) -> tuple[str | None, set[str], int | None]:
    """Poll one launch until it ends: (None, ...) when it finished cleanly, else (failure,
    unreachable hosts, exit code). The code is read before the rest is stopped: the survivors
    would exit 0 on SIGTERM and hide the crash."""
    last_step, last_change = None, time.monotonic()
    while True:
        run, hosts = launch.run_hosts(inventory, registry, name)
        procs = launch.processes(fleet, registry, name, run, hosts)
        progress = run.read_status()
        since = registry.launches(name)[-1]["time"]
        if any(e.kind == "stop_requested" and e.time >= since for e in run.events()):
            say(f"run {name} was stopped (rlmctl stop)")
            return None, set(), 0
        unreachable = {h for h, p in procs.items() if p.alive is None}
        dead = {h for h, p in procs.items() if p.alive is False}
        if unreachable:
            return f"host(s) {', '.join(sorted(unreachable))} unreachable", unreachable, None
        if dead and len(dead) == len(procs):
            fresh = float(progress.get("updated", 0)) >= since
            if fresh and progress.get("state") == "done" and progress.get("exit_code") == 0:
                say(f"run {name} done at step {progress.get('step')}")
                return None, set(), 0
            if fresh and stopped_before_end(progress):
                # Saved and exited on a signal rlmctl did not send (preemption): resume it.
                step = progress.get("step")
                return f"trainer stopped on a signal at step {step} (preempted)", set(), None
            code = launch.exit_code(run, sorted(dead), since)
            return "all trainer processes exited", set(), code
        if dead:
            code = launch.exit_code(run, sorted(dead), since)
            return f"trainer process gone on {', '.join(sorted(dead))}", set(), code
        step = progress.get("step")
        if step != last_step:
            if last_step is not None:
                say(f"step {step} loss {progress.get('loss')}")
            last_step, last_change = step, time.monotonic()
        elif time.monotonic() - last_change > policy.stall_s:
            return f"no step progress for {policy.stall_s:g} s (stuck at step {step})", set(), None
        time.sleep(policy.poll_s)  # polling interval of the supervisor, not a synchronisation

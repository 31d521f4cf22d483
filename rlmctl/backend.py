"""The backend interface: the little that differs between ways of starting the trainer.

The run lifecycle (rlmctl.lifecycle: name, claim, config, launch, status, stop, resume,
refuse-done, exit codes, watch) is written once against `Backend`. `rlm_scheduler` of the
selected hosts names the backend, the module `rlmctl/backend_<name>.py` that defines `Backend`
(`ssh`: torchrun started over SSH and tracked per host; `slurm`: the job submitted to Slurm, which
allocates, signals and accounts). Backends never import each other or the lifecycle; a third one
is one more such module (and its name among rlm_scheduler's choices in clusterspec/variables.yml).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from clusterspec.inventory import Host
from rlmctl.health import Report
from rlmctl.records import HostProcesses, HostStop
from runcontract.rundir import RunDir

Say = Callable[[str], None]


def quiet(_: str) -> None:
    pass


@dataclass(frozen=True)
class LaunchRequest:
    """`rlmctl launch`'s options. `force` is the SSH health gate's (under Slurm the
    HealthCheckProgram keeps unhealthy nodes out); `partition` and `time_limit` are Slurm's.
    `memory_check`: refuse a config whose memory estimate does not fit the GPUs (rlmctl plan)."""

    config: Path
    overrides: list[str] = field(default_factory=list)
    name: str | None = None
    nodes: int | None = None
    force: bool = False
    partition: str | None = None
    time_limit: str = "24:00:00"
    memory_check: bool = True
    # Slurm's site options from the command line (account, qos, reservation, constraint): they
    # replace the inventory's rlm_slurm_<key> for this run
    site: dict[str, str] = field(default_factory=dict)
    # Slurm: jobs chained with afterany, each resuming from the one before (launch --segments)
    segments: int = 1


@dataclass(frozen=True)
class Placement:
    """Where an attempt runs: `hosts` (SSH: exactly these, first host holds the rendezvous;
    Slurm: none, Slurm picks `nodes` nodes), GPUs per node, and what Slurm is asked for."""

    hosts: list[Host]
    nodes: int
    gpus_per_node: int
    template: Host  # the host whose facts (GPUs, memory, python, shared dir) stand for all
    partition: str | None = None
    time_limit: str = "24:00:00"
    exclude: list[str] = field(default_factory=list)
    force: bool = False  # SSH: run on hosts that fail the gate
    site: dict[str, str] = field(default_factory=dict)  # Slurm: the command line's site options
    segments: int = 1  # Slurm: a chain of this many jobs (a launch only)

    @property
    def world_size(self) -> int:
        return sum(h.gpus_per_node for h in self.hosts) or self.nodes * self.gpus_per_node

    @property
    def gpu_memory_gib(self) -> float | None:
        """GiB per GPU of the smallest GPU of the placement (rlm_gpu_memory_gib), if known."""
        known = [h.gpu_memory_gib for h in self.hosts or [self.template]]
        return None if None in known else min(m for m in known if m is not None)


@dataclass(frozen=True)
class Attempt:
    """One start of a run's trainer: a launch, or a resume from `resume_from` (the trainer's
    checkpoint.resume: a verified checkpoint directory, or `never`)."""

    kind: str  # "launch" or "resume"
    resume_from: str | None = None
    overrides: tuple[str, ...] = ()  # config overrides of this attempt (a chosen interval)


@dataclass(frozen=True)
class Started:
    """What a backend started: on which hosts (SSH) or as which job (Slurm)."""

    hosts: list[str]
    processes: list[dict[str, Any]] = field(default_factory=list)  # the registry's host rows
    rdzv_id: str = ""  # the registry's launch id: rendezvous id (SSH) or Slurm job id
    rdzv_endpoint: str = ""
    job_id: str | None = None
    failures: list[str] = field(default_factory=list)  # hosts that could not start, why


@dataclass(frozen=True)
class Probe:
    """What a backend sees of a run's newest attempt, and how to say it.

    `alive`: anything of the run can still run (a process, orphaned or not; a pending or running
    job): stop has work, resume must wait. `running`: the attempt goes on (a launcher alive; a
    job Slurm holds). `complete`: every part of it goes on (each host's launcher). `executing`:
    where it computes now (hosts with live launchers; the job while RUNNING): the stall clock of
    `watch` runs only then. `gone`: hosts whose launcher ended while others run."""

    alive: bool
    running: bool
    complete: bool
    executing: list[str]
    unreachable: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    not_running: str = ""  # "no trainer process is alive on node2" / "Slurm job 7 is FAILED"
    still_running: str = ""  # "processes remain on node2" / "Slurm job 7 is still RUNNING"
    ended: str = ""  # how the whole attempt ended, for watch's failure line
    recovery: str = ""  # what an operator runs next when it died
    hosts: list[HostProcesses] = field(default_factory=list)
    job: dict[str, str] | None = None  # Slurm's view of the job (status, stop)
    ref: dict[str, Any] = field(default_factory=dict)  # what events name the attempt by


class Backend(Protocol):
    """What the lifecycle asks of whatever starts the trainer. Every method raises an
    `RlmctlError` (one line) for what an operator can fix."""

    def placement(self, request: LaunchRequest) -> Placement:
        """Where a new launch asks to run (no host contacted yet)."""
        ...

    def placement_of(self, run: RunDir, exclude: set[str]) -> Placement:
        """Where a resume of `run` asks to run: what it ran on before, less `exclude`."""
        ...

    def admit(self, run: RunDir, placement: Placement, attempt: Attempt, say: Say) -> Placement:
        """The cluster's yes before anything is written or started: SSH runs the health gate
        (a launch refuses failed hosts unless forced, a resume leaves them out), Slurm asks
        `sbatch --test-only`. The placement to start."""
        ...

    def start(self, run: RunDir, placement: Placement, attempt: Attempt, say: Say) -> Started:
        """Start (or submit) the attempt, detached; what started and where it failed."""
        ...

    def commands(self, run: RunDir, placement: Placement, attempt: Attempt) -> dict[str, str]:
        """What `start` would run, by host (SSH: the launcher's command line) or by file
        (Slurm: the batch script), without running it (`--dry-run`)."""
        ...

    def stop_commands(
        self, run: RunDir, probe: Probe, timeout: float, leave_out: set[str]
    ) -> dict[str, str]:
        """What `stop` would signal or run now, by host, signalling nothing (`--dry-run`)."""
        ...

    def abandon(self, run: RunDir) -> bool:
        """Undo an attempt being started (interrupted, or partly failed): stop or cancel what
        it may have started; True when nothing of it can still run."""
        ...

    def tend(self, run: RunDir, say: Say) -> None:
        """On every poll of `watch`, what the scheduler needs of it (Slurm: record a requeue it
        made, lift its requeue hold); nothing over SSH."""
        ...

    def probe(self, run: RunDir) -> Probe:
        """The newest attempt as processes or the scheduler see it; reads only."""
        ...

    def stop(
        self, run: RunDir, probe: Probe, timeout: float, leave_out: set[str]
    ) -> list[HostStop]:
        """SIGTERM (the trainer checkpoints and exits 0), then kill after `timeout`; per host
        (or per job) whether nothing is left. Hosts in `leave_out` are not contacted."""
        ...

    def failed_hosts(self, run: RunDir, probe: Probe) -> list[str]:
        """The hosts a failed attempt must not get again."""
        ...

    def in_service(self, hosts: list[str]) -> dict[str, str]:
        """Which of the excluded `hosts` the next attempt may have again, each with the
        evidence (Slurm: the node is in service again, its health check passing); the
        lifecycle decides whether one may come back (`WatchPolicy.strikes`)."""
        ...

    def log_paths(self, run: RunDir, host: str | None) -> dict[str, Path]:
        """The launcher logs of the run by name (host, or Slurm job output)."""
        ...

    def node_checks(self, report: Report) -> None:
        """Add the backend's own view of each host (e.g. Slurm's drain state) to `report`."""
        ...

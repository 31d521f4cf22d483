"""What rlmctl commands return: typed records, turned into tables or JSON by rlmctl.render.

The command functions (rlmctl.lifecycle and the backends) build these and never print; the
CLI picks a rendering. Run states are runcontract.states.RunState, the one state machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from runcontract.states import RunState


def as_dict(record: Any) -> Any:
    """A record (or list of them) as plain JSON-ready values; enums become their values."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: as_dict(getattr(record, f.name)) for f in dataclasses.fields(record)}
    if isinstance(record, Enum):
        return record.value
    if isinstance(record, list | tuple):
        return [as_dict(item) for item in record]
    if isinstance(record, dict):
        return {str(k): as_dict(v) for k, v in record.items()}
    return record


@dataclass(frozen=True)
class HostProcesses:
    host: str
    alive: bool | None  # None: the host did not answer
    processes: int | None
    error: str | None = None


@dataclass(frozen=True)
class CheckpointRow:
    step: int
    path: str
    valid: bool
    reason: str
    size_bytes: int
    age_s: float


@dataclass(frozen=True)
class RunStatus:
    run: str
    state: RunState | None  # of record, from the run directory's events
    run_dir: str
    hosts: list[HostProcesses]
    step: int | None
    max_steps: int | None
    loss: float | None
    tokens_per_s: float | None
    updated: float | None
    exit_code: int | None
    checkpoint: CheckpointRow | None
    restarts: int  # trainer starts after the first one (runcontract.rundir.RunDir.restarts)
    problem: str | None = None  # what the processes say against the state of record
    # rlm_scheduler slurm: the run's job as Slurm reports it (job_id, state, exit_code, nodes).
    slurm: dict[str, str] | None = None
    # Where the run's wall time went and its stragglers (rlmctl.goodput.run_view).
    goodput: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None and self.state not in (RunState.FAILED, None)


@dataclass(frozen=True)
class RunSummary:
    name: str
    state: RunState | None
    hosts: list[str]
    restarts: int
    created: float
    run_dir: str
    inventory: str


@dataclass(frozen=True)
class HostStop:
    host: str
    ok: bool
    found: int = 0
    killed: int = 0
    remaining: list[Any] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class StopResult:
    run: str
    state: RunState | None  # after the stop
    hosts: list[HostStop]
    skipped: str | None = None  # why nothing was signalled (the run had already ended)
    slurm: dict[str, str] | None = None  # rlm_scheduler slurm: the job after the stop

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.hosts)


@dataclass(frozen=True)
class Launched:
    run: str
    run_dir: str
    hosts: list[str]
    rdzv_endpoint: str
    kind: str = "launch"
    job_id: str | None = None  # rlm_scheduler slurm


@dataclass(frozen=True)
class DryRun:
    """What `launch`, `resume` or `stop` would run (`--dry-run`): by host, or by batch script
    file name under Slurm; nothing was written, started or signalled."""

    run: str
    run_dir: str
    action: str  # "launch", "resume" or "stop"
    commands: dict[str, str]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LayoutChoice:
    """GiB per GPU of each parallel layout and the cheapest that fits (None: none does)."""

    per_gpu_gib: dict[str, float]
    pick: str | None


@dataclass(frozen=True)
class MemoryEstimate:
    """Memory per GPU without or with activation checkpointing."""

    activation_checkpointing: bool
    activations_gib: float
    unsharded_per_gpu_gib: float
    unsharded_fits: bool
    min_gpus_sharded: int | None
    max_micro_batch_at_min_gpus: int | None
    layouts: LayoutChoice


@dataclass(frozen=True)
class Plan:
    """`rlmctl plan`: the model, the GPU memory it needs and the layout to run it with."""

    model: str
    params: int
    seq_len: int
    micro_batch: int
    gpu_mem_gib: float
    usable_gib: float
    static_gib: float
    rule_of_thumb_gpus: int
    gpus: int
    gpus_per_node: int
    estimates: list[MemoryEstimate]

"""The scheduler interface: what rlmctl's run commands ask of whatever starts the trainer.

`rlm_scheduler` in the inventory picks one implementation per invocation (`for_site`):
`ssh` (rlmctl.launch.SshScheduler: torchrun started over SSH, processes tracked per host) or
`slurm` (rlmctl.scheduler_slurm.SlurmScheduler: the job submitted to Slurm, which allocates,
signals and accounts). Both take the same `Site` and answer the same methods with the same
records, so the CLI holds no per-scheduler branch and renders one set of results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the CLI imports this module on every command: nothing heavy at import time
    from clusterspec.inventory import Host, Inventory
    from rlmctl.health import Report
    from rlmctl.records import Launched, RunStatus, StopResult
    from rlmctl.registry import Registry
    from rlmctl.remote import Fleet
    from rlmctl.supervise import WatchPolicy

Say = Callable[[str], None]


class Site(Protocol):
    """The inventory, the selected hosts and how to reach them (the CLI's session)."""

    def inventory(self) -> Inventory: ...
    def hosts(self) -> list[Host]: ...
    def fleet(self, hosts: list[Host] | None = None) -> Fleet: ...
    def registry(self, readonly: bool = False) -> Registry: ...


@dataclass(frozen=True)
class LaunchRequest:
    """`rlmctl launch`'s options. `force` is the SSH health gate's (under Slurm the
    HealthCheckProgram keeps unhealthy nodes out); `partition` and `time_limit` are Slurm's
    (the SSH path has neither)."""

    config: Path
    overrides: list[str] = field(default_factory=list)
    name: str | None = None
    nodes: int | None = None
    force: bool = False
    partition: str | None = None
    time_limit: str = "24:00:00"


class Scheduler(Protocol):
    """One launcher behind `rlmctl launch/status/stop/resume/watch` and health's node view."""

    def launch(self, request: LaunchRequest, say: Say) -> Launched:
        """Create the run directory and registry entry and start (or submit) the run; what
        is refused leaves neither behind."""
        ...

    def status(self, run: str) -> RunStatus:
        """The run's state of record next to what its launcher says; reads only."""
        ...

    def stop(self, run: str, timeout: float) -> StopResult:
        """SIGTERM (the trainer checkpoints and exits), then kill after `timeout`."""
        ...

    def resume(self, run: str, exclude: set[str], force: bool, say: Say) -> Launched:
        """Relaunch a stopped or failed run from its newest verified checkpoint, leaving out
        the hosts in `exclude`."""
        ...

    def watch(self, run: str, policy: WatchPolicy, say: Say) -> int:
        """Supervise until the run is done (0) or cannot be restarted (1)."""
        ...

    def node_checks(self, fleet: Fleet, report: Report) -> None:
        """Add the scheduler's own view of each host (e.g. Slurm's drain state) to `report`."""
        ...


def for_site(site: Site) -> Scheduler:
    """The implementation that `rlm_scheduler` of the selected hosts names."""
    hosts = site.hosts()
    kinds = {h.scheduler for h in hosts}
    if len(kinds) > 1:
        from rlmctl.errors import RlmctlError

        raise RlmctlError(
            f"selected hosts disagree on rlm_scheduler ({', '.join(sorted(kinds))}); "
            "set it once for the whole group in the inventory"
        )
    if kinds == {"slurm"}:
        from rlmctl.scheduler_slurm import SlurmScheduler

        return SlurmScheduler(site)
    from rlmctl.launch import SshScheduler

    return SshScheduler(site)

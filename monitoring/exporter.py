"""`rlm-exporter`: one per node; GPU, job, trainer-process, shared-filesystem and network metrics.

Anything that can be slow or hang (vendor tools, the run directories and the shared filesystem,
which is Lustre in production) is read by a background thread per source; a scrape only renders
the newest snapshot, so it never waits on them. A snapshot older than its maximum age is dropped:
its series disappear instead of going stale, and `rlm_exporter_source_up{source}` says 0.

Process and network counters come from procfs/sysfs at scrape time (cheap, never hang).
The `host` label is not set here: Prometheus attaches it from the file_sd target labels.
Stdlib, psutil and prometheus-client only; never torch (the exporter must start fast on every node).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, cast

import psutil
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from clusterspec.variables import default
from monitoring import goodput as goodput_series
from monitoring import gpu
from trainer.rundir import RunDir

log = logging.getLogger("rlm-exporter")

DEFAULT_PORT = default("rlm_exporter_port")
RUN_STATES = ("starting", "running", "done", "stopped", "failed")
# A finished run stays visible this long so dashboards show how it ended.
FINISHED_RUN_VISIBLE_S = 3600.0
# The link error counters (PCIe replays, NVLink) are read every this many GPU reads.
COUNTERS_EVERY = 6
NETWORK_FILESYSTEMS = {"lustre", "nfs", "nfs4", "beegfs", "gpfs", "ceph", "cephfs", "wekafs"}


class Source:
    """Runs `probe` every `interval_s` on a daemon thread and keeps its newest result.

    A failing probe never stops the thread: the error is counted, the result is cleared (so no
    stale series are exported) and the next interval tries again.
    """

    def __init__(
        self, name: str, probe: Callable[[], Any], interval_s: float, errors: ErrorCounts
    ) -> None:
        self.name = name
        self.probe = probe
        self._errors = errors
        self.interval_s = interval_s
        # The probe's own timeout is interval-bound, so three intervals means it is stuck.
        self.max_age_s = 3 * interval_s + 10
        self._lock = threading.Lock()
        self._result: Any = None
        self._updated = 0.0
        self._ok = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"source-{name}", daemon=True)

    def start(self) -> Source:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def refresh(self) -> None:
        # What the probe counts as it goes (a file it could not read) shows with the result it
        # publishes, not while it still runs: a scrape never sees the errors without their run.
        with self._errors.held():
            try:
                result, ok = self.probe(), True
            except Exception as error:  # a source must never take the exporter down
                result, ok = None, False
                self._errors.count(self.name, error)
            with self._lock:
                self._result, self._ok, self._updated = result, ok, time.monotonic()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.refresh()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def snapshot(self) -> tuple[bool, Any]:
        """(fresh and successful, result); the result is None when it must not be exported."""
        with self._lock:
            fresh = self._updated and time.monotonic() - self._updated <= self.max_age_s
            if not fresh:
                return False, None
            return self._ok, self._result


class ErrorCounts:
    """Errors per source (vendor tool, dmesg, rundir, sharedfs), each counter present from 0.

    Logging is rate-limited per source: at most one line per `log_every_s`, saying how many
    errors it did not print, so a source failing every interval (or partly working, with two
    different complaints) does not flood the journal; the counter keeps counting every error.
    """

    def __init__(
        self,
        sources: Iterable[str] = (),
        log_every_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = dict.fromkeys(sources, 0)
        self.log_every_s = log_every_s
        self._clock = clock
        self._last_logged: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self._held = threading.local()  # .pending: this thread's errors inside held()

    def add_source(self, source: str) -> None:
        with self._lock:
            self.counts.setdefault(source, 0)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Errors this thread counts inside are applied when it ends."""
        self._held.pending = []
        try:
            yield
        finally:
            pending, self._held.pending = self._held.pending, None
            for source, error in pending:
                self._apply(source, error)

    def count(self, source: str, error: BaseException | str) -> None:
        pending = getattr(self._held, "pending", None)
        if pending is not None:
            pending.append((source, error))
        else:
            self._apply(source, error)

    def _apply(self, source: str, error: BaseException | str) -> None:
        now = self._clock()
        with self._lock:
            self.counts[source] = self.counts.get(source, 0) + 1
            last = self._last_logged.get(source)
            if last is not None and now - last < self.log_every_s:
                self._unlogged[source] = self._unlogged.get(source, 0) + 1
                return
            self._last_logged[source] = now
            unlogged = self._unlogged.pop(source, 0)
        more = f" ({unlogged} more errors since the last line)" if unlogged else ""
        log.warning("%s: %s%s", source, str(error)[:300], more)

    def items(self) -> list[tuple[str, int]]:
        with self._lock:
            return sorted(self.counts.items())


# GPU -------------------------------------------------------------------------------------------
@dataclass
class GpuSnapshot:
    gpus: list[gpu.GpuReading]


def pci_label(bus: tuple[int, int, int] | None) -> str:
    return "" if bus is None else "{:04x}:{:02x}:{:02x}".format(*bus)


class GpuProbe:
    """Runs the vendor tool; remembers every GPU it has listed since the exporter started.

    A GPU that falls off the bus is no longer listed: the remembered identity (index, UUID, PCI
    address) keeps `rlm_gpu_present` at 0 for it and names its XIDs.
    """

    def __init__(self, source: str, timeout_s: float, errors: ErrorCounts) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self.errors = errors
        self._lock = threading.Lock()
        self._known: dict[str, gpu.GpuReading] = {}  # identity key -> the newest reading

    @staticmethod
    def key(reading: gpu.GpuReading) -> str:
        return reading.uuid or pci_label(reading.pci_bus) or f"index-{reading.gpu}"

    def __call__(self) -> GpuSnapshot:
        output = gpu.run_tool(gpu.COMMANDS[self.source], self.timeout_s, self.source)
        if output.returncode != 0:
            message = f"{self.source} exited with {output.returncode}: {output.stderr_tail}"
            if not output.stdout.strip():
                raise gpu.ToolError(message)
            self.errors.count(self.source, message)
        parsed = gpu.PARSERS[self.source](output.stdout)
        if not parsed.gpus:
            raise gpu.ToolError(f"{self.source} reported no GPUs: {'; '.join(parsed.problems)}")
        for problem in parsed.problems:
            self.errors.count(self.source, problem)
        with self._lock:
            self._known.update((self.key(reading), reading) for reading in parsed.gpus)
        return GpuSnapshot(parsed.gpus)

    def known(self) -> list[gpu.GpuReading]:
        with self._lock:
            return list(self._known.values())

    def by_bus(self) -> dict[tuple[int, int, int], gpu.GpuReading]:
        return {r.pci_bus: r for r in self.known() if r.pci_bus is not None}


class KernelLogProbe:
    """XID events per (PCI address, code) since boot, from the kernel log (NVIDIA only).

    Runs on its own, so XIDs are read when the SMI tool fails or no longer lists the GPU. Lines
    are remembered, so events that rotate out of the ring buffer are not lost and the counts only
    grow: counters, for increase() over a window.
    """

    def __init__(self, source: str, timeout_s: float) -> None:
        self.command, self.xid_events = gpu.KERNEL_LOGS[source]
        self.timeout_s = timeout_s
        self._lines: dict[tuple[tuple[int, int, int], int], set[str]] = {}

    def __call__(self) -> dict[tuple[tuple[int, int, int], int], int]:
        output = gpu.run_tool(self.command, self.timeout_s, "dmesg")
        if output.returncode != 0:
            raise gpu.ToolError(f"dmesg exited with {output.returncode}: {output.stderr_tail}")
        for bus, events in self.xid_events(output.stdout).items():
            for code, line in events:
                self._lines.setdefault((bus, code), set()).add(line)
        return {key: len(lines) for key, lines in self._lines.items()}


class CountersProbe:
    """The vendor's link error counters (PCIe replays, NVLink errors), read on their own and less
    often than the GPU tool: `nvidia-smi -q` is the expensive call."""

    def __init__(self, source: str, timeout_s: float, errors: ErrorCounts) -> None:
        self.source = source
        self.command, self.parse = gpu.COUNTERS[source]
        self.timeout_s = timeout_s
        self.errors = errors

    def __call__(self) -> gpu.LinkCounters:
        output = gpu.run_tool(self.command, self.timeout_s, f"{self.source} counters")
        counters = self.parse(output.stdout)
        if not counters.pcie_replays and not counters.interconnect_errors:
            raise gpu.ToolError(f"{self.source} printed no link counters: {output.stderr_tail}")
        for problem in counters.problems:
            self.errors.count("gpu-counters", problem)
        return counters


# Run directories --------------------------------------------------------------------------------
@dataclass
class RunSnapshot:
    name: str
    status: dict[str, Any]
    # None where events.jsonl could not be read: a counter must not drop to 0 and back.
    restarts: int | None = None
    checkpoint_failures: int | None = None
    # event kind -> time of its newest line in events.jsonl: the dashboard's annotations
    event_times: dict[str, float] = field(default_factory=dict)
    checkpoint_step: int | None = None
    checkpoint_mtime: float | None = None
    exit_codes: list[int] = field(default_factory=list)  # of the newest attempt
    goodput: dict[str, Any] | None = None  # runcontract.goodput, as of a moment ago
    ranks: dict[str, Any] | None = None  # this host's ranks and the stragglers (ranks.json)
    logs_updated: float | None = None  # newest mtime of the launcher logs and metrics.jsonl
    # Run files that exist but cannot be read or parsed (status.json, events.jsonl): counted as
    # errors and exported, since the run then shows with no state and nothing else can fire.
    unreadable: list[str] = field(default_factory=list)


def find_run_dirs(run_roots: Iterable[Path], run_dirs: Iterable[Path]) -> list[Path]:
    found = list(run_dirs)
    for root in run_roots:
        try:
            children = sorted(root.iterdir())
        except FileNotFoundError:
            continue  # not mounted yet, or no run started: nothing to report
        found += [
            child
            for child in children
            if (child / "status.json").exists() or (child / "events.jsonl").exists()
        ]
    return found


def status_unreadable(path: Path) -> bool:
    """Whether a status.json that RunDir read as empty exists but is not a readable JSON object
    (the trainer replaces it atomically, so a reader never sees a torn one)."""
    try:
        return not isinstance(json.loads(path.read_text(encoding="utf-8")), dict)
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True


def newest_mtime(paths: Iterable[Path]) -> float | None:
    times = []
    for path in paths:
        with contextlib.suppress(OSError):
            times.append(path.stat().st_mtime)
    return max(times, default=None)


def read_run(path: Path) -> RunSnapshot:
    run = RunDir(path)
    status = run.read_status()
    unreadable = ["status.json"] if not status and status_unreadable(run.status_path) else []
    try:
        events = run.events()
    except OSError:
        return RunSnapshot(run.name, status, unreadable=[*unreadable, run.events_path.name])
    checkpoint = run.latest_valid_checkpoint()
    logs = [run.metrics_path, *(run.path / "hosts").glob("*/launcher.log")]
    return RunSnapshot(
        name=run.name,
        status=status,
        restarts=run.restarts(),
        checkpoint_failures=sum(1 for e in events if e.kind == "checkpoint_failed"),
        event_times={e.kind: e.time for e in events if e.kind and e.time > 0},
        checkpoint_step=checkpoint.step if checkpoint else None,
        checkpoint_mtime=checkpoint.mtime if checkpoint else None,
        exit_codes=run.attempt_exit_codes(events),
        logs_updated=newest_mtime(logs),
        unreadable=unreadable,
    )


def is_visible(snapshot: RunSnapshot, now: float) -> bool:
    state = snapshot.status.get("state")
    if state in ("starting", "running") or not snapshot.status:
        return True
    updated = snapshot.status.get("updated")
    return isinstance(updated, int | float) and now - updated < FINISHED_RUN_VISIBLE_S


class RunProbe:
    """Every run directory under the run roots. A root that cannot be listed fails the source
    (a hung or lost shared filesystem); a run whose files cannot be read is exported with them
    named (rlm_run_unreadable) and each counted as an error."""

    def __init__(self, run_roots: list[Path], run_dirs: list[Path], errors: ErrorCounts) -> None:
        self.run_roots = run_roots
        self.run_dirs = run_dirs
        self.errors = errors
        self.goodput = goodput_series.GoodputReader()

    def __call__(self) -> list[RunSnapshot]:
        snapshots = []
        for path in find_run_dirs(self.run_roots, self.run_dirs):
            try:
                snapshot = read_run(path)
            except OSError as error:
                snapshot = RunSnapshot(
                    path.name, {}, unreadable=[Path(error.filename or path).name]
                )
            for name in snapshot.unreadable:
                self.errors.count("rundir", f"cannot read {name} of run directory {path}")
            snapshots.append(snapshot)
        now = time.time()
        # A run whose files cannot be read stays in view: rlm_run_unreadable names them.
        visible = [s for s in snapshots if s.unreadable or is_visible(s, now)]
        self.goodput.add_to(visible, self.run_roots, self.run_dirs)
        return visible


# Shared filesystem ------------------------------------------------------------------------------
@dataclass
class FilesystemSnapshot:
    path: str
    mounted: bool
    fstype: str
    size_bytes: float
    avail_bytes: float


def mount_of(path: Path) -> tuple[str, str]:
    """(mount point, fstype) of the mount holding `path`: the longest matching mount point."""
    resolved = os.path.realpath(path)
    best = ("/", "")
    for part in psutil.disk_partitions(all=True):
        point = part.mountpoint
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, part.fstype)
    return best


def probe_filesystem(path: Path) -> FilesystemSnapshot:
    stats = os.statvfs(path)  # on a hung Lustre this blocks: that is why it runs in a Source
    mountpoint, fstype = mount_of(path)
    return FilesystemSnapshot(
        path=str(path),
        mounted=mountpoint != "/" or fstype in NETWORK_FILESYSTEMS,
        fstype=fstype,
        size_bytes=float(stats.f_blocks * stats.f_frsize),
        avail_bytes=float(stats.f_bavail * stats.f_frsize),
    )


# Scrape-time readers ------------------------------------------------------------------------------
def runs_trainer(argv: list[str]) -> bool:
    """True for trainer worker processes (`python -m trainer train`, `rlm-train train`).

    torchrun's agent carries the same arguments but holds no GPU memory, and so do the processes
    that start it (rlmctl's launcher shell, `sh -c WRAPPER rlmctl-launcher python -m
    torch.distributed.run ... -m trainer train`; `podman run IMAGE python3 -m
    torch.distributed.run ...`): a command line that names torchrun before the trainer is not
    counted.
    """
    names = [os.path.basename(arg) for arg in argv]
    for i, name in enumerate(names):
        if name in ("torchrun", "torch.distributed.run"):
            return False
        if name == "rlm-train" or (name == "trainer" and i > 0 and argv[i - 1] == "-m"):
            return argv[i + 1 : i + 2] == ["train"]
    return False


def run_of(argv: list[str]) -> str:
    """The run a trainer command line works for: the name of its `run_dir=` override (rlmctl and
    the Slurm batch script always pass one); "" when it has none."""
    paths = [arg.split("=", 1)[1] for arg in argv if arg.startswith("run_dir=")]
    return os.path.basename(paths[-1].rstrip("/")) if paths else ""


@dataclass
class TrainerProcess:
    process: psutil.Process
    run: str  # "" when the command line names no run directory


def trainer_processes(proc: str = "/proc") -> list[TrainerProcess]:
    # Plain reads of /proc/<pid>/cmdline, cheapest first: psutil.process_iter costs ~10x more per
    # process. No caching by PID: a forked worker shows its parent's command line until it execs.
    found = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/cmdline", "rb") as f:
                raw = f.read()
        except OSError:
            continue  # exited meanwhile
        argv = raw.decode(errors="replace").split("\0")[:-1] if b"train" in raw else []
        if argv and runs_trainer(argv):
            with contextlib.suppress(psutil.Error):
                found.append(TrainerProcess(psutil.Process(int(name)), run_of(argv)))
    return found


def link_speed_bytes(device: str) -> float | None:
    """Link speed in bytes/s; None when unknown (-1, down, or a virtual device without one)."""
    try:
        mbit = int((Path("/sys/class/net") / device / "speed").read_text().strip())
    except (OSError, ValueError):
        return None
    return mbit * 125_000.0 if mbit > 0 else None


# Collector ------------------------------------------------------------------------------------
GPU_FAMILIES = (
    ("utilization_ratio", GaugeMetricFamily, "rlm_gpu_utilization_ratio", "GPU busy fraction"),
    ("memory_used_bytes", GaugeMetricFamily, "rlm_gpu_memory_used_bytes", "GPU memory in use"),
    ("memory_total_bytes", GaugeMetricFamily, "rlm_gpu_memory_total_bytes", "GPU memory size"),
    ("temperature_celsius", GaugeMetricFamily, "rlm_gpu_temperature_celsius", "Hottest sensor"),
    (
        "memory_temperature_celsius",
        GaugeMetricFamily,
        "rlm_gpu_memory_temperature_celsius",
        "HBM temperature",
    ),
    ("power_watts", GaugeMetricFamily, "rlm_gpu_power_watts", "GPU power draw"),
    ("power_limit_watts", GaugeMetricFamily, "rlm_gpu_power_limit_watts", "Enforced power cap"),
    (
        "row_remap_pending",
        GaugeMetricFamily,
        "rlm_gpu_row_remap_pending",
        "1 while a remapped memory row waits for a GPU reset",
    ),
    (
        "row_remap_failed",
        GaugeMetricFamily,
        "rlm_gpu_row_remap_failed",
        "1 once a memory row remap has failed",
    ),
    (
        "ecc_uncorrected_total",
        CounterMetricFamily,
        "rlm_gpu_ecc_uncorrected_errors",
        "Uncorrected ECC errors since the driver loaded",
    ),
    (
        "ecc_corrected_total",
        CounterMetricFamily,
        "rlm_gpu_ecc_corrected_errors",
        "Corrected ECC errors since the driver loaded",
    ),
)


class RlmCollector(Collector):
    def __init__(
        self,
        gpu_source: str | None,
        gpu_state: Source | None,
        runs: Source | None,
        filesystem: Source | None,
        errors: ErrorCounts,
        kernel_log: Source | None = None,
        expected_gpus: int | None = None,
        processes: Source | None = None,
        counters: Source | None = None,
    ) -> None:
        self.gpu_source = gpu_source
        self.errors = errors
        self.counters = counters
        sources = (gpu_state, kernel_log, counters, runs, filesystem, processes)
        self.sources = {s.name: s for s in sources if s}
        self.processes = processes
        self.gpu_state = gpu_state
        self.kernel_log = kernel_log
        self.expected_gpus = expected_gpus
        self.runs = runs
        self.filesystem = filesystem

    def collect(self) -> Iterator[Metric]:
        yield from self._exporter_metrics()
        yield from self._gpu_metrics()
        yield from self._xid_metrics()
        yield from self._run_metrics()
        yield from self._filesystem_metrics()
        yield from self._process_metrics()
        yield from self._network_metrics()

    def _exporter_metrics(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "rlm_exporter_gpu_source_info",
            "Where GPU metrics come from: nvidia-smi, amd-smi, rocm-smi or none",
            labels=["source"],
        )
        info.add_metric([self.gpu_source or "none"], 1)
        yield info
        up = GaugeMetricFamily(
            "rlm_exporter_source_up",
            "1 when the source's newest background read succeeded and is fresh",
            labels=["source"],
        )
        for name, source in self.sources.items():
            ok, _ = source.snapshot()
            up.add_metric([name], 1 if ok else 0)
        yield up
        errors = CounterMetricFamily(
            "rlm_exporter_errors",
            "Failed reads per source: vendor tool failed, hung or printed garbage, run dir unreadable",
            labels=["source"],
        )
        for name, count in self.errors.items():
            errors.add_metric([name], count)
        yield errors

    def _gpu_metrics(self) -> Iterator[Metric]:
        if self.gpu_state is None:
            return
        if self.expected_gpus is not None:
            expected = GaugeMetricFamily(
                "rlm_gpus_expected", "GPUs this node should have (rlm_gpus_per_node)"
            )
            expected.add_metric([], self.expected_gpus)
            yield expected
        _, snapshot = self.gpu_state.snapshot()
        listed = snapshot.gpus if snapshot is not None else []
        seen = GaugeMetricFamily(
            "rlm_gpus_seen", "GPUs the vendor tool listed in its newest read (0 when it failed)"
        )
        seen.add_metric([], len(listed))
        yield seen
        probe = cast(GpuProbe, self.gpu_state.probe)  # main() builds gpu_state on a GpuProbe
        listed_keys = {probe.key(r) for r in listed}
        present = GaugeMetricFamily(
            "rlm_gpu_present",
            "1 while the vendor tool lists this GPU; 0 for one listed earlier that is gone",
            labels=["gpu", "uuid", "pci_bus"],
        )
        info = GaugeMetricFamily(
            "rlm_gpu_info",
            "Identity of each GPU seen since the exporter started",
            labels=["gpu", "uuid", "serial", "pci_bus", "name", "driver"],
        )
        for reading in sorted(probe.known(), key=lambda r: (int(r.gpu), probe.key(r))):
            bus = pci_label(reading.pci_bus)
            present.add_metric(
                [reading.gpu, reading.uuid or "", bus],
                1 if probe.key(reading) in listed_keys else 0,
            )
            identity = (reading.serial, reading.name, reading.driver)
            info.add_metric([reading.gpu, reading.uuid or "", identity[0] or "", bus,
                             identity[1] or "", identity[2] or ""], 1)  # fmt: skip
        yield from (present, info)
        for attribute, family_type, name, documentation in GPU_FAMILIES:
            family = family_type(name, documentation, labels=["gpu", "uuid"])
            for reading in listed:
                value = getattr(reading, attribute)
                if value is not None:
                    family.add_metric([reading.gpu, reading.uuid or ""], value)
            if family.samples:
                yield family
        yield from self._clock_and_link_metrics(listed)

    def _clock_and_link_metrics(self, listed: list[gpu.GpuReading]) -> Iterator[Metric]:
        """Clock event reasons, PCIe replays and interconnect errors: from the GPU tool's reading
        (amd-smi) or from the link counters read on their own (nvidia-smi -q, nvlink -e)."""
        _, counters = self.counters.snapshot() if self.counters else (False, None)
        clock = GaugeMetricFamily(
            "rlm_gpu_clock_event",
            "1 while the GPU's clocks are held back for this reason (sw_power_cap is normal at "
            "full load)",
            labels=["gpu", "uuid", "reason"],
        )
        replays = CounterMetricFamily(
            "rlm_gpu_pcie_replays", "PCIe replays (link-level retries)", labels=["gpu", "uuid"]
        )
        links = CounterMetricFamily(
            "rlm_gpu_interconnect_errors",
            "NVLink (per link) and XGMI error counters",
            labels=["gpu", "uuid", "link", "counter"],
        )
        for reading in listed:
            identity = [reading.gpu, reading.uuid or ""]
            for reason, state in sorted(reading.clock_events.items()):
                clock.add_metric([*identity, reason], state)
            replay_count = reading.pcie_replays_total
            errors = dict(reading.interconnect_errors)
            if counters is not None:
                replay_count = counters.pcie_replays.get(reading.pci_bus, replay_count)
                errors.update(counters.interconnect_errors.get(reading.uuid, {}))
            if replay_count is not None:
                replays.add_metric(identity, replay_count)
            for (link, counter), value in sorted(errors.items()):
                links.add_metric([*identity, link, counter], value)
        yield from (family for family in (clock, replays, links) if family.samples)

    def _xid_metrics(self) -> Iterator[Metric]:
        if self.kernel_log is None or self.gpu_state is None:
            return
        _, counts = self.kernel_log.snapshot()
        if counts is None:
            return
        by_bus = cast(GpuProbe, self.gpu_state.probe).by_bus()
        xid = CounterMetricFamily(
            "rlm_gpu_xid_errors",
            "NVIDIA XID events in the kernel log since boot, per GPU and XID code",
            labels=["gpu", "uuid", "pci_bus", "xid"],
        )
        for (bus, code), count in sorted(counts.items()):
            reading = by_bus.get(bus)  # None: a GPU the tool never listed since we started
            identity = [reading.gpu, reading.uuid or ""] if reading else ["", ""]
            xid.add_metric([*identity, pci_label(bus), str(code)], count)
        yield xid

    def _run_metrics(self) -> Iterator[Metric]:
        if self.runs is None:
            return
        _, snapshots = self.runs.snapshot()
        if not snapshots:
            return
        state = GaugeMetricFamily(
            "rlm_run_state", "1 for the run's state in status.json", labels=["run", "state"]
        )
        status_gauges = {
            "step": GaugeMetricFamily("rlm_run_step", "Last step in status.json", labels=["run"]),
            "updated": GaugeMetricFamily(
                "rlm_run_last_step_timestamp_seconds",
                "When status.json was last written (unix time)",
                labels=["run"],
            ),
            "max_steps": GaugeMetricFamily("rlm_run_max_steps", "Planned steps", labels=["run"]),
            "checkpoint_interval_steps": GaugeMetricFamily(
                "rlm_run_checkpoint_interval_steps", "Steps between checkpoints", labels=["run"]
            ),
            "step_time": GaugeMetricFamily(
                "rlm_run_step_duration_seconds",
                "Mean step time since the previous status.json",
                labels=["run"],
            ),
            "comm_time": GaugeMetricFamily(
                "rlm_run_comm_duration_seconds",
                "Mean gradient communication time per step (rank 0), same window",
                labels=["run"],
            ),
        }
        restarts = CounterMetricFamily(
            "rlm_run_restarts", "Trainer starts after the first one", labels=["run"]
        )
        failures = CounterMetricFamily(
            "rlm_run_checkpoint_failures", "checkpoint_failed events", labels=["run"]
        )
        checkpoint_step = GaugeMetricFamily(
            "rlm_run_checkpoint_step", "Step of the newest verified checkpoint", labels=["run"]
        )
        checkpoint_age = GaugeMetricFamily(
            "rlm_run_checkpoint_age_seconds",
            "Age of the newest verified checkpoint",
            labels=["run"],
        )
        exit_code = GaugeMetricFamily(
            "rlm_run_exit_code",
            "Exit code of the newest attempt: the first non-zero one of the trainer and each "
            "host's torchrun, else 0; absent while none has exited",
            labels=["run"],
        )
        event_times = GaugeMetricFamily(
            "rlm_run_event_timestamp_seconds",
            "When the newest event of each kind in events.jsonl happened (unix time)",
            labels=["run", "event"],
        )
        logs_updated = GaugeMetricFamily(
            "rlm_run_logs_updated_timestamp_seconds",
            "Newest change of the run's launcher logs and metrics.jsonl (unix time)",
            labels=["run"],
        )
        unreadable = GaugeMetricFamily(
            "rlm_run_unreadable",
            "1 for a run file that exists but cannot be read or parsed",
            labels=["run", "file"],
        )
        now = time.time()
        for run in snapshots:
            for name in run.unreadable:
                unreadable.add_metric([run.name, name], 1)
            if run.logs_updated is not None:
                logs_updated.add_metric([run.name], run.logs_updated)
            if run.exit_codes:
                failing = [code for code in run.exit_codes if code != 0]
                exit_code.add_metric([run.name], failing[0] if failing else 0)
            current = run.status.get("state")
            for name in RUN_STATES:
                state.add_metric([run.name, name], 1.0 if current == name else 0.0)
            for key, family in status_gauges.items():
                value = run.status.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    family.add_metric([run.name], value)
            for kind, when in sorted(run.event_times.items()):
                event_times.add_metric([run.name, kind], when)
            if run.restarts is not None:
                restarts.add_metric([run.name], run.restarts)
            if run.checkpoint_failures is not None:
                failures.add_metric([run.name], run.checkpoint_failures)
            if run.checkpoint_step is not None and run.checkpoint_mtime is not None:
                checkpoint_step.add_metric([run.name], run.checkpoint_step)
                checkpoint_age.add_metric([run.name], max(0.0, now - run.checkpoint_mtime))
        yield state
        yield from status_gauges.values()
        yield from (restarts, failures, checkpoint_step, checkpoint_age, exit_code)
        yield from (event_times, logs_updated, unreadable)
        yield from goodput_series.families(snapshots)

    def _filesystem_metrics(self) -> Iterator[Metric]:
        if self.filesystem is None:
            return
        _, fs = self.filesystem.snapshot()
        if fs is None:
            return
        for name, documentation, value in (
            (
                "rlm_shared_fs_mounted",
                "1 when the shared directory is on its own mount",
                fs.mounted,
            ),
            ("rlm_shared_fs_size_bytes", "Size of the shared filesystem", fs.size_bytes),
            ("rlm_shared_fs_avail_bytes", "Space available to users", fs.avail_bytes),
        ):
            family = GaugeMetricFamily(name, documentation, labels=["path", "fstype"])
            family.add_metric([fs.path, fs.fstype], float(value))
            yield family

    def _process_metrics(self) -> Iterator[Metric]:
        alive = GaugeMetricFamily("rlm_trainer_processes", "Trainer worker processes alive")
        rss = GaugeMetricFamily(
            "rlm_trainer_resident_memory_bytes", "Trainer worker RSS", labels=["pid"]
        )
        fds = GaugeMetricFamily("rlm_trainer_open_fds", "Trainer worker open files", labels=["pid"])
        per_run = GaugeMetricFamily(
            "rlm_run_workers",
            "Trainer workers of the run on this host (from their run_dir= argument)",
            labels=["run"],
        )
        runs: dict[str, int] = {}
        count = 0
        # The background scan's newest list (a scrape only reads each worker's own /proc files);
        # without that source, a scan now.
        if self.processes is None:
            workers = trainer_processes()
        else:
            workers = self.processes.snapshot()[1] or []
        for worker in workers:
            process = worker.process
            try:
                memory = process.memory_info().rss  # /proc/<pid>/statm: readable by anyone
            except psutil.Error:
                continue  # exited between listing and reading
            count += 1
            if worker.run:
                runs[worker.run] = runs.get(worker.run, 0) + 1
            pid = str(process.pid)
            rss.add_metric([pid], memory)
            # /proc/<pid>/fd is readable only by the worker's own user (or with CAP_SYS_PTRACE):
            # the role's exporter (User=rlm-exporter) cannot count the open files of a trainer
            # started as root or as the service user. The worker still counts, with its run.
            with contextlib.suppress(psutil.Error):
                fds.add_metric([pid], process.num_fds())
        alive.add_metric([], count)
        for run, workers_of_run in sorted(runs.items()):
            per_run.add_metric([run], workers_of_run)
        yield from (alive, rss, fds, per_run)

    def _network_metrics(self) -> Iterator[Metric]:
        received = CounterMetricFamily(
            "rlm_network_receive_bytes", "Bytes received", labels=["device"]
        )
        sent = CounterMetricFamily("rlm_network_transmit_bytes", "Bytes sent", labels=["device"])
        speed = GaugeMetricFamily(
            "rlm_network_speed_bytes",
            "Link speed in bytes/s (absent when unknown)",
            labels=["device"],
        )
        for device, counters in sorted(psutil.net_io_counters(pernic=True).items()):
            if device == "lo":
                continue
            received.add_metric([device], counters.bytes_recv)
            sent.add_metric([device], counters.bytes_sent)
            link = link_speed_bytes(device)
            if link is not None:
                speed.add_metric([device], link)
        yield from (received, sent, speed)


# Command line ----------------------------------------------------------------------------------
def default_address() -> str:
    """The node's cluster address: IPv4 of the default-route interface, else of the first
    non-loopback interface (isolated cluster networks often have no default route)."""
    try:
        routes = [line.split() for line in Path("/proc/net/route").read_text().splitlines()[1:]]
    except OSError:
        routes = []
    default = [fields[0] for fields in routes if fields[1:2] == ["00000000"]]
    addresses = psutil.net_if_addrs()
    for interface in default + sorted(name for name in addresses if name != "lo"):
        for address in addresses.get(interface, []):
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return "127.0.0.1"


def build_collector(args: argparse.Namespace) -> RlmCollector:
    source = gpu.detect_source() if args.gpu_source == "auto" else args.gpu_source
    source = None if source == "none" else source
    timeout_s = min(args.interval, 10.0)
    gpu_state = kernel_log = counters = runs = filesystem = None
    errors = ErrorCounts()
    if source:
        gpu_state = Source(source, GpuProbe(source, timeout_s, errors), args.interval, errors)
        if source in gpu.KERNEL_LOGS:
            probe: Callable[[], Any] = KernelLogProbe(source, timeout_s)
            kernel_log = Source("dmesg", probe, args.interval, errors)
        if source in gpu.COUNTERS:
            # Counters for 15-minute windows: every COUNTERS_EVERY reads of the GPU tool.
            interval = args.interval * COUNTERS_EVERY
            probe = CountersProbe(source, min(interval, 30.0), errors)
            counters = Source("gpu-counters", probe, interval, errors)
    if args.run_root or args.run_dir:
        probe = RunProbe(args.run_root, args.run_dir, errors)
        runs = Source("rundir", probe, args.interval, errors)
    # Finding the workers reads every process's command line (~8 ms with a few thousand
    # processes): a background scan, not a cost of every scrape.
    processes = Source("processes", trainer_processes, args.interval, errors)
    shared = args.shared_dir or (args.run_root[0] if args.run_root else None)
    if shared:
        filesystem = Source("sharedfs", lambda: probe_filesystem(shared), args.interval, errors)
    collector = RlmCollector(
        source, gpu_state, runs, filesystem, errors, kernel_log, args.expected_gpus, processes,
        counters,
    )  # fmt: skip
    for name in collector.sources:
        errors.add_source(name)  # every error counter exists from 0, for rate()/increase()
    return collector


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports bad input as one line (what is wrong, where to look), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="rlm-exporter", description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="listen address (default: default-route interface)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument(
        "--run-root", type=Path, action="append", default=[], help="directory of run directories"
    )
    parser.add_argument("--run-dir", type=Path, action="append", default=[], help="one run dir")
    parser.add_argument(
        "--shared-dir", type=Path, help="shared filesystem to watch (default: first --run-root)"
    )
    parser.add_argument("--gpu-source", choices=("auto", "none", *gpu.SOURCES), default="auto")
    parser.add_argument(
        "--expected-gpus",
        type=int,
        help="GPUs this node should have (rlm_gpus_per_node): exported for the GpuMissing alert",
    )
    parser.add_argument(
        "--interval", type=float, default=10.0, help="seconds between background reads"
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="read every source once, print the metrics (text exposition format) and exit",
    )
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be positive, e.g. --interval 10")
    if args.expected_gpus is not None and args.expected_gpus < 0:
        parser.error("--expected-gpus must be 0 or more, e.g. --expected-gpus 8")
    return args


def serve(collector: RlmCollector, address: str, port: int) -> Any:
    """Start the HTTP server and the background sources; returns the server (for tests)."""
    registry = CollectorRegistry()
    registry.register(collector)
    server, _ = start_http_server(port, addr=address, registry=registry)
    for source in collector.sources.values():
        source.start()
    return server


def print_once(collector: RlmCollector) -> None:
    """What one scrape would return, on stdout: for checks and for hosts without Prometheus."""
    from prometheus_client import generate_latest

    for source in collector.sources.values():
        source.refresh()
    registry = CollectorRegistry()
    registry.register(collector)
    sys.stdout.write(generate_latest(registry).decode())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    collector = build_collector(args)
    if args.once:
        print_once(collector)
        return 0
    address = args.address or default_address()
    try:
        serve(collector, address, args.port)
    except OSError as error:
        print(
            f"error: cannot listen on {address}:{args.port}: {error.strerror}; "
            "pick a free --port or another --address",
            file=sys.stderr,
        )
        return 2
    log.info(
        "serving http://%s:%d/metrics (gpu source: %s)",
        address,
        args.port,
        collector.gpu_source or "none",
    )
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

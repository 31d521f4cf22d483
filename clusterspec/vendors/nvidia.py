"""NVIDIA: everything rlm-ops knows about the vendor in one place (stdlib only, Python 3.8).

Tools and their flags, the one parser of each tool's output (used by the health gate and the
exporter), the XID rules, peak FLOP/s and all-reduce floors per SKU, torch's device and backend.
The Ansible roles gpu_nvidia/comm hold the package repositories and driver versions.
"""

from __future__ import annotations

import csv
import re
from typing import Any

from clusterspec.vendors import nvidia_topology
from clusterspec.vendors.description import DeviceFiles, GresFiles, Vendor
from clusterspec.vendors.readings import (
    MIB,
    GpuReading,
    LinkCounters,
    ParseResult,
    active,
    number,
    pci_key,
    scaled,
    snake,
    text_or_none,
)

NAME = "nvidia"
TORCH_DEVICE = "cuda"
DIST_BACKEND = "nccl"
# The vendor's own exporter (gpu_exporter role): Prometheus job name and port (file_sd).
EXPORTER_JOB = ("dcgm", 9400)
# GPU topology: its command, parser and expected GPU-to-GPU link per SKU (nvidia_topology.py).
TOPOLOGY = nvidia_topology.TOOL
BANDWIDTH_TEST = "all_reduce_perf"  # nccl-tests

# nvidia-smi --query-gpu fields, in groups: one unknown field fails a whole query ("Field ... is
# not a valid field to query"), so a field an older driver lacks costs only its own group. Every
# group starts with `index` so the rows can be joined. clocks_event_reasons.* is the current name
# (clocks_throttle_reasons.* are deprecated aliases). Field names and value formats ("Active",
# "Not Active", "Yes", "No", "[N/A]") as nvidia-smi 590.48.01 prints them on an H100 80GB HBM3
# (tests/monitoring/fixtures/README.md says where that recording is).
CLOCK_EVENT_FIELDS = {  # field -> reason (readings.CLOCK_EVENT_REASONS)
    "clocks_event_reasons.sw_power_cap": "sw_power_cap",
    "clocks_event_reasons.hw_slowdown": "hw_slowdown",
    "clocks_event_reasons.hw_thermal_slowdown": "hw_thermal_slowdown",
    "clocks_event_reasons.hw_power_brake_slowdown": "hw_power_brake_slowdown",
    "clocks_event_reasons.sw_thermal_slowdown": "sw_thermal_slowdown",
}
QUERY_GROUPS = (
    ("index", "pci.bus_id", "uuid", "serial", "name", "driver_version"),
    (
        "index",
        "utilization.gpu",
        "memory.used",
        "memory.total",
        "temperature.gpu",
        "power.draw",
        "enforced.power.limit",
    ),
    ("index", "ecc.errors.uncorrected.volatile.total", "ecc.errors.corrected.volatile.total"),
    ("index", *CLOCK_EVENT_FIELDS),
    # HBM temperature and row remapping (Ampere and later): fields an older driver lacks.
    ("index", "temperature.memory", "remapped_rows.pending", "remapped_rows.failure"),
)
FIELDS = tuple(dict.fromkeys(field for group in QUERY_GROUPS for field in group))
# Marker lines between the groups' outputs (nvidia-smi never prints a line starting with "#").
GROUP_MARK = "# rlm-query "
EXIT_MARK = "# rlm-exit "


def _marked(commands: list[tuple[str, str]]) -> tuple[str, ...]:
    """One command (sh) that runs each (mark, command) and marks its output; it exits with the
    first command's status (the one that lists the GPUs)."""
    parts = []
    for i, (mark, command) in enumerate(commands):
        parts.append(
            "echo '" + GROUP_MARK + mark + "'; " + command + " 2>&1; "
            "s=$?; echo '" + EXIT_MARK + "'$s" + ("; first=$s" if i == 0 else "")
        )
    return ("sh", "-c", "; ".join(parts) + "; exit $first")


NVIDIA_SMI = _marked(
    [
        (
            ",".join(group),
            "nvidia-smi --query-gpu=" + ",".join(group) + " --format=csv,noheader,nounits",
        )
        for group in QUERY_GROUPS
    ]
)
# Tool name -> the command whose output its parser reads; detection order.
TOOLS = {"nvidia-smi": NVIDIA_SMI}
# Link error counters, read less often than TOOLS (nvidia-smi -q is the expensive call): the PCIe
# replay counter (only in -q's PCI section) and the NVLink error counters per link.
COUNTERS = {"nvidia-smi": _marked([("query", "nvidia-smi -q"), ("nvlink", "nvidia-smi nvlink -e")])}
# The kernel ring buffer is where the driver reports XID events (reading it usually needs root).
KERNEL_LOG = ("dmesg",)

# XIDs that mean the GPU (or its memory) needs draining, and ones worth a look (facts.md).
XID_CRITICAL = frozenset(
    {48, 62, 64, 74, 79, 92, 94, 95, *range(56, 59), *range(68, 74), *range(75, 78)}
    | {*range(80, 87), 88, 89, *range(96, 106), *range(110, 121), *range(122, 126)}
)
XID_WARNING = frozenset({13, 31, 43, 45, 63, 109})
# "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
_XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\): (\d+)")

# Dense bf16 tensor-core peak per device, from the datasheets; longest matching key wins.
PEAK_BF16_FLOPS = {
    "A100": 312e12,
    "H100": 989e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
}
# Published single-node busbw of a 16 GiB all-reduce (nccl-tests), GB/s.
BUSBW_FLOORS_GBPS = {"A100": 228.0, "H100": 460.0, "H200": 480.0}


def _sections(
    text: str, fields: tuple[str, ...]
) -> list[tuple[tuple[str, ...], list[str], int | None]]:
    """(mark split at commas, lines, exit status or None) per marked part of the output."""
    if GROUP_MARK not in text:
        return [(fields, text.splitlines(), None)]  # one plain --query-gpu output
    sections: list[tuple[tuple[str, ...], list[str], int | None]] = []
    for line in text.splitlines():
        if line.startswith(GROUP_MARK):
            sections.append((tuple(line[len(GROUP_MARK) :].strip().split(",")), [], None))
        elif line.startswith(EXIT_MARK) and sections:
            status = line[len(EXIT_MARK) :].strip()
            group, lines, _ = sections[-1]
            sections[-1] = (group, lines, int(status) if status.isdigit() else None)
        elif sections:
            sections[-1][1].append(line)
    return sections


def parse_nvidia_smi(text: str, fields: tuple[str, ...] = FIELDS) -> ParseResult:
    """Parse the grouped query (NVIDIA_SMI), or one `--query-gpu=<fields>
    --format=csv,noheader,nounits` output (`fields` says what was asked for)."""
    rows: dict[int, dict[str, str]] = {}
    problems: list[str] = []
    for group, lines, status in _sections(text, fields):
        unreadable, readable = [], 0
        for row in csv.reader(line for line in lines if line.strip()):
            cells = [cell.strip() for cell in row]
            if len(cells) != len(group) or not cells[0].isdigit():
                unreadable.append("unreadable nvidia-smi line: " + ",".join(cells)[:120])
                continue
            readable += 1
            rows.setdefault(int(cells[0]), {}).update(zip(group, cells))
        if status and not readable:  # the whole group was refused: say which fields and why
            message = next((line.strip() for line in lines if line.strip()), "no output")
            unreadable = [
                "nvidia-smi rejected "
                + ",".join(group[1:])
                + " (exit "
                + str(status)
                + "): "
                + message[:120]
            ]
        problems += unreadable
    gpus = [_reading(rows[index]) for index in sorted(rows)]
    return ParseResult(gpus, list(dict.fromkeys(problems)))


def _clock_events(values: dict[str, str]) -> dict[str, float]:
    events = {}
    for field, reason in CLOCK_EVENT_FIELDS.items():
        alias = field.replace("clocks_event_reasons.", "clocks_throttle_reasons.")
        state = active(values.get(field, values.get(alias)))
        if state is not None:
            events[reason] = state
    return events


def _reading(values: dict[str, str]) -> GpuReading:
    bus = re.fullmatch(
        r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.\d", values.get("pci.bus_id", "")
    )
    return GpuReading(
        gpu=values["index"],
        utilization_ratio=scaled(number(values.get("utilization.gpu")), 0.01),
        memory_used_bytes=scaled(number(values.get("memory.used")), MIB),
        memory_total_bytes=scaled(number(values.get("memory.total")), MIB),
        temperature_celsius=number(values.get("temperature.gpu")),
        memory_temperature_celsius=number(values.get("temperature.memory")),
        power_watts=number(values.get("power.draw")),
        power_limit_watts=number(values.get("enforced.power.limit")),
        ecc_uncorrected_total=number(values.get("ecc.errors.uncorrected.volatile.total")),
        ecc_corrected_total=number(values.get("ecc.errors.corrected.volatile.total")),
        row_remap_pending=active(values.get("remapped_rows.pending")),
        row_remap_failed=active(values.get("remapped_rows.failure")),
        clock_events=_clock_events(values),
        name=text_or_none(values.get("name")),
        driver=text_or_none(values.get("driver_version")),
        uuid=text_or_none(values.get("uuid")),
        serial=text_or_none(values.get("serial")),
        pci_bus=pci_key(*bus.groups()) if bus else None,
    )


PARSERS = {"nvidia-smi": parse_nvidia_smi}

# `nvidia-smi -q`: "GPU 00000000:18:00.0" opens a GPU's block; its PCI section holds
# "        Replays Since Reset                            : 9".
_Q_GPU_RE = re.compile(r"^GPU ([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.\d\s*$")
_Q_REPLAYS_RE = re.compile(r"^\s+Replays Since Reset\s*:\s*(.+?)\s*$")
# `nvidia-smi nvlink -e`: "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)" then per link
# "         Link 0: Replay Errors: 0" (newer drivers print more counters the same way).
_NVLINK_GPU_RE = re.compile(r"^GPU \d+: .*\(UUID: ([^)]+)\)")
_NVLINK_COUNTER_RE = re.compile(r"^\s+Link (\d+): ([A-Za-z][A-Za-z -]*?): (\S+)\s*$")


def parse_pcie_replays(text: str) -> tuple[dict[tuple[int, int, int], float], list[str]]:
    """({(domain, bus, device): replays}, problems) from `nvidia-smi -q`."""
    replays: dict[tuple[int, int, int], float] = {}
    problems: list[str] = []
    bus = None
    for line in text.splitlines():
        header = _Q_GPU_RE.match(line)
        if header:
            bus = pci_key(*header.groups())
            continue
        match = _Q_REPLAYS_RE.match(line)
        if match and bus is not None:
            value = number(match.group(1))
            if value is None:
                problems.append("unreadable nvidia-smi -q replay count: " + line.strip()[:120])
            else:
                replays[bus] = value
    return replays, problems


def parse_nvlink_errors(
    text: str,
) -> tuple[dict[str, dict[tuple[str, str], float]], list[str]]:
    """({uuid: {(link, counter): value}}, problems) from `nvidia-smi nvlink -e`."""
    errors: dict[str, dict[tuple[str, str], float]] = {}
    problems: list[str] = []
    uuid = None
    for line in text.splitlines():
        header = _NVLINK_GPU_RE.match(line)
        if header:
            uuid = header.group(1).strip()
            errors.setdefault(uuid, {})
            continue
        match = _NVLINK_COUNTER_RE.match(line)
        if match and uuid is not None:
            value = number(match.group(3))
            if value is not None:
                errors[uuid][(match.group(1), snake(match.group(2)))] = value
        elif line.strip() and uuid is None:
            problems.append("unreadable nvidia-smi nvlink line: " + line.strip()[:120])
    return errors, problems


def parse_link_counters(text: str) -> LinkCounters:
    """The COUNTERS output: -q's PCIe replays and nvlink -e's error counters. A part that failed
    (a driver without NVLink support says so and exits non-zero) is a problem, not an error."""
    counters = LinkCounters()
    for mark, lines, status in _sections(text, ("query",)):
        body = "\n".join(lines)
        if status:
            first = next((line.strip() for line in lines if line.strip()), "no output")
            counters.problems.append(
                "nvidia-smi " + mark[0] + " exited " + str(status) + ": " + first[:120]
            )
            continue
        if mark[0] == "query":
            counters.pcie_replays, problems = parse_pcie_replays(body)
        else:
            counters.interconnect_errors, problems = parse_nvlink_errors(body)
        counters.problems += problems
    return counters


COUNTER_PARSERS = {"nvidia-smi": parse_link_counters}


def xid_events(kernel_log: str) -> dict[tuple[int, int, int], list[tuple[int, str]]]:
    """(code, line) of each XID in a kernel log, grouped by the GPU's PCI (domain, bus, device)."""
    events: dict[tuple[int, int, int], list[tuple[int, str]]] = {}
    for line in kernel_log.splitlines():
        match = _XID_RE.search(line)
        if match:
            key = pci_key(*match.groups()[:3])
            events.setdefault(key, []).append((int(match.group(4)), line.strip()))
    return events


def judge_xids(codes: list[int]) -> tuple[str, str]:
    """("CRIT" | "WARN" | "OK", detail) for the XID codes seen."""
    critical = sorted(set(codes) & XID_CRITICAL)
    if critical:
        return "CRIT", "critical XIDs in kernel log: " + str(critical)
    warning = sorted(set(codes) & XID_WARNING)
    if warning:
        return "WARN", "XIDs in kernel log: " + str(warning)
    return "OK", "no XID errors in kernel log"


# --- Read by the Ansible roles (plugins/lookup/rlm_vendor.py, plugins/filter/rlm_vendor.py) ---
PCI_VENDOR_ID = "10de"  # lspci -n (gpu_detect)
KERNEL_MODULE = "nvidia"  # /sys/module/<name> exists while the driver is loaded
# Device nodes of the loaded driver: a control node and one node per GPU (a glob in `dir`).
DEVICE_FILES: DeviceFiles = {"control": "/dev/nvidiactl", "dir": "/dev", "per_gpu": "nvidia[0-9]*"}
# gres.conf File= (slurm role): /dev/nvidia0.. for GPU 0.. of nvidia-smi.
GRES_FILES: GresFiles = {"prefix": "/dev/nvidia", "first": 0}
TOOLKIT_HOME = "/usr/local/cuda"
# nccl-tests at a pinned tag; built with `make` and these arguments ({toolkit}: TOOLKIT_HOME).
BANDWIDTH_TEST_SOURCE = ("https://github.com/NVIDIA/nccl-tests.git", "v2.13.11")
BANDWIDTH_TEST_MAKE_ARGS = ("CUDA_HOME={toolkit}", "NCCL_HOME=/usr")
NET_PLUGIN = "aws-ofi-nccl"  # NCCL over libfabric (EFA): comm_net_plugin
# The exporter of EXPORTER_JOB (gpu_exporter): its packages and services.
EXPORTER_PACKAGES = ("datacenter-gpu-manager", "dcgm-exporter")
EXPORTER_SERVICES = ("nvidia-dcgm", "dcgm-exporter")
TORCH_INDEX_URL = "https://download.pytorch.org/whl/cu124"
# Power caps (gpu_power): the query parse_power_limits reads, then per GPU ({gpu}, {watts}) the
# command enabling persistence mode and the one setting the cap; the boot unit runs after
# POWER_AFTER (caps set before the persistence daemon starts are lost).
POWER_QUERY = (
    "nvidia-smi",
    "--query-gpu=index,power.min_limit,power.max_limit,power.limit,power.default_limit,"
    "persistence_mode",
    "--format=csv,noheader,nounits",
)
POWER_PERSISTENCE = ("nvidia-smi", "-i", "{gpu}", "-pm", "1")
POWER_SET = ("nvidia-smi", "-i", "{gpu}", "-pl", "{watts}")
POWER_AFTER = "nvidia-persistenced.service"


def parse_power_limits(text: str) -> list[dict[str, Any]]:
    """Each GPU's {index, min, max, current, default} cap in W and persistence from POWER_QUERY."""
    gpus: list[dict[str, Any]] = []
    for row in csv.reader(line for line in text.splitlines() if line.strip()):
        cells = [cell.strip() for cell in row]
        if len(cells) != 6 or not cells[0].isdigit():
            raise ValueError("unreadable nvidia-smi power line: " + ",".join(cells)[:120])
        watts = [number(cell) for cell in cells[1:5]]
        limits: dict[str, Any] = dict(zip(("min", "max", "current", "default"), watts))
        gpus.append({**limits, "index": int(cells[0]), "persistence": cells[5]})
    return gpus


# The GPUs' model for gres.conf Type= (clusterspec/binding.py): one name per line.
NAME_QUERY = ("nvidia-smi", "--query-gpu=name", "--format=csv,noheader")
BRAND_WORDS = frozenset({"NVIDIA", "TESLA"})


def parse_names(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


DESCRIPTION = Vendor(
    NAME=NAME,
    TORCH_DEVICE=TORCH_DEVICE,
    DIST_BACKEND=DIST_BACKEND,
    TOOLS=TOOLS,
    PARSERS=PARSERS,
    COUNTERS=COUNTERS,
    COUNTER_PARSERS=COUNTER_PARSERS,
    KERNEL_LOG=KERNEL_LOG,
    XID_CRITICAL=XID_CRITICAL,
    XID_WARNING=XID_WARNING,
    xid_events=xid_events,
    judge_xids=judge_xids,
    PEAK_BF16_FLOPS=PEAK_BF16_FLOPS,
    BUSBW_FLOORS_GBPS=BUSBW_FLOORS_GBPS,
    BANDWIDTH_TEST=BANDWIDTH_TEST,
    TOPOLOGY=TOPOLOGY,
    NAME_QUERY=NAME_QUERY,
    parse_names=parse_names,
    BRAND_WORDS=BRAND_WORDS,
    EXPORTER_JOB=EXPORTER_JOB,
    PCI_VENDOR_ID=PCI_VENDOR_ID,
    KERNEL_MODULE=KERNEL_MODULE,
    DEVICE_FILES=DEVICE_FILES,
    GRES_FILES=GRES_FILES,
    TOOLKIT_HOME=TOOLKIT_HOME,
    BANDWIDTH_TEST_SOURCE=BANDWIDTH_TEST_SOURCE,
    BANDWIDTH_TEST_MAKE_ARGS=BANDWIDTH_TEST_MAKE_ARGS,
    NET_PLUGIN=NET_PLUGIN,
    EXPORTER_PACKAGES=EXPORTER_PACKAGES,
    EXPORTER_SERVICES=EXPORTER_SERVICES,
    TORCH_INDEX_URL=TORCH_INDEX_URL,
    POWER_QUERY=POWER_QUERY,
    POWER_PERSISTENCE=POWER_PERSISTENCE,
    POWER_SET=POWER_SET,
    POWER_AFTER=POWER_AFTER,
    parse_power_limits=parse_power_limits,
)

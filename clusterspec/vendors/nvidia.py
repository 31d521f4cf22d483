"""NVIDIA: everything rlm-ops knows about the vendor in one place (stdlib only, Python 3.8).

Tools and their flags, the one parser of each tool's output (used by the health gate and the
exporter), the XID rules, peak FLOP/s and all-reduce floors per SKU, torch's device and backend.
The Ansible roles gpu_nvidia/comm hold the package repositories and driver versions.
"""

from __future__ import annotations

import csv
import re

from clusterspec.vendors import nvidia_topology
from clusterspec.vendors.readings import (
    MIB,
    GpuReading,
    ParseResult,
    number,
    pci_key,
    scaled,
    text_or_none,
)

NAME = "nvidia"
TORCH_DEVICE = "cuda"
DIST_BACKEND = "nccl"
# The vendor's own exporter (gpu_exporter role): Prometheus job name and port (file_sd).
EXPORTER_JOB = ("dcgm", 9400)
# GPU topology: its command, parser and expected GPU-to-GPU link per SKU (nvidia_topology.py).
TOPOLOGY = nvidia_topology
BANDWIDTH_TEST = "all_reduce_perf"  # nccl-tests

# nvidia-smi --query-gpu fields, in groups: one unknown field fails a whole query ("Field ... is
# not a valid field to query"), so a field an older driver lacks costs only its own group. Every
# group starts with `index` so the rows can be joined. clocks_event_reasons.* is the current name
# (clocks_throttle_reasons.* are deprecated aliases).
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
    ("index", "clocks_event_reasons.sw_power_cap"),
)
FIELDS = tuple(dict.fromkeys(field for group in QUERY_GROUPS for field in group))
# Marker lines between the groups' outputs (nvidia-smi never prints a line starting with "#").
GROUP_MARK = "# rlm-query "
EXIT_MARK = "# rlm-exit "


def _grouped_query(groups: tuple) -> tuple:
    """One command (sh) that runs one nvidia-smi query per group and marks each output; it exits
    with the first group's status (the one that lists the GPUs)."""
    parts = []
    for i, group in enumerate(groups):
        query = ",".join(group)
        parts.append(
            "echo '" + GROUP_MARK + query + "'; "
            "nvidia-smi --query-gpu=" + query + " --format=csv,noheader,nounits 2>&1; "
            "s=$?; echo '" + EXIT_MARK + "'$s" + ("; first=$s" if i == 0 else "")
        )
    return ("sh", "-c", "; ".join(parts) + "; exit $first")


NVIDIA_SMI = _grouped_query(QUERY_GROUPS)
# Tool name -> the command whose output its parser reads; detection order.
TOOLS = {"nvidia-smi": NVIDIA_SMI}
# The kernel ring buffer is where the driver reports XID events (reading it usually needs root).
KERNEL_LOG = ("dmesg",)

# XIDs that mean the GPU (or its memory) needs draining, and ones worth a look (facts.md).
XID_CRITICAL = {48, 62, 64, 74, 79, 92, 94, 95, *range(56, 59), *range(68, 74), *range(75, 78)}
XID_CRITICAL |= {*range(80, 87), 88, 89, *range(96, 106), *range(110, 121), *range(122, 126)}
XID_WARNING = {13, 31, 43, 45, 63, 109}
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


def _sections(text: str, fields: tuple) -> list:
    """(fields, lines, exit status or None) per query group of the output."""
    if GROUP_MARK not in text:
        return [(fields, text.splitlines(), None)]  # one plain --query-gpu output
    sections: list = []
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


def parse_nvidia_smi(text: str, fields: tuple = FIELDS) -> ParseResult:
    """Parse the grouped query (NVIDIA_SMI), or one `--query-gpu=<fields>
    --format=csv,noheader,nounits` output (`fields` says what was asked for)."""
    rows: dict = {}
    problems: list = []
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


def _reading(values: dict) -> GpuReading:
    bus = re.fullmatch(
        r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.\d", values.get("pci.bus_id", "")
    )
    throttle = values.get(
        "clocks_event_reasons.sw_power_cap", values.get("clocks_throttle_reasons.sw_power_cap", "")
    ).lower()
    return GpuReading(
        gpu=values["index"],
        utilization_ratio=scaled(number(values.get("utilization.gpu")), 0.01),
        memory_used_bytes=scaled(number(values.get("memory.used")), MIB),
        memory_total_bytes=scaled(number(values.get("memory.total")), MIB),
        temperature_celsius=number(values.get("temperature.gpu")),
        power_watts=number(values.get("power.draw")),
        power_limit_watts=number(values.get("enforced.power.limit")),
        ecc_uncorrected_total=number(values.get("ecc.errors.uncorrected.volatile.total")),
        ecc_corrected_total=number(values.get("ecc.errors.corrected.volatile.total")),
        power_throttled={"active": 1.0, "not active": 0.0}.get(throttle),
        name=text_or_none(values.get("name")),
        driver=text_or_none(values.get("driver_version")),
        uuid=text_or_none(values.get("uuid")),
        serial=text_or_none(values.get("serial")),
        pci_bus=pci_key(*bus.groups()) if bus else None,
    )


PARSERS = {"nvidia-smi": parse_nvidia_smi}


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
DEVICE_FILES = {"control": "/dev/nvidiactl", "dir": "/dev", "per_gpu": "nvidia[0-9]*"}
TOOLKIT_HOME = "/usr/local/cuda"
# nccl-tests at a pinned tag; built with `make` and these arguments ({toolkit}: TOOLKIT_HOME).
BANDWIDTH_TEST_SOURCE = ("https://github.com/NVIDIA/nccl-tests.git", "v2.13.11")
BANDWIDTH_TEST_MAKE_ARGS = ("CUDA_HOME={toolkit}", "NCCL_HOME=/usr")
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


def parse_power_limits(text: str) -> list[dict]:
    """Each GPU's {index, min, max, current, default} cap in W and persistence from POWER_QUERY."""
    gpus = []
    for row in csv.reader(line for line in text.splitlines() if line.strip()):
        cells = [cell.strip() for cell in row]
        if len(cells) != 6 or not cells[0].isdigit():
            raise ValueError("unreadable nvidia-smi power line: " + ",".join(cells)[:120])
        watts = [number(cell) for cell in cells[1:5]]
        row = dict(zip(("min", "max", "current", "default"), watts))
        gpus.append(dict(row, index=int(cells[0]), persistence=cells[5]))
    return gpus

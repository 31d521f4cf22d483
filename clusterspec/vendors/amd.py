"""AMD: everything rlm-ops knows about the vendor in one place (stdlib only, Python 3.8).

Tools and their flags (amd-smi, and the deprecated rocm-smi where amd-smi is missing), the one
parser of each tool's output (used by the health gate and the exporter), RAS rules, peak FLOP/s
and all-reduce floors per SKU, torch's device and backend (ROCm builds of torch keep the "cuda"
device type and map "nccl" onto RCCL). The roles gpu_amd/comm hold repositories and versions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from clusterspec.vendors import amd_topology
from clusterspec.vendors.description import DeviceFiles, GresFiles, Vendor
from clusterspec.vendors.readings import (
    MIB,
    GpuReading,
    LinkCounters,
    ParseResult,
    ToolError,
    active,
    number,
    scaled,
    text_or_none,
)

NAME = "amd"
TORCH_DEVICE = "cuda"
DIST_BACKEND = "nccl"
# The vendor's own exporter (gpu_exporter role): Prometheus job name and port (file_sd).
EXPORTER_JOB = ("amd-device-metrics", 5000)
# GPU topology: its command, parser and expected GPU-to-GPU link per SKU (amd_topology.py).
TOPOLOGY = amd_topology.TOOL
BANDWIDTH_TEST = "all_reduce_perf"  # rccl-tests

AMD_SMI = ("amd-smi", "metric", "--json")
# --showallinfo prints no VRAM usage; --showmeminfo vram adds it (rocm-smi 5.x source).
ROCM_SMI = ("rocm-smi", "--showallinfo", "--showmeminfo", "vram", "--json")
# Detection order: the current tool before the deprecated one.
TOOLS = {"amd-smi": AMD_SMI, "rocm-smi": ROCM_SMI}
# amd-smi metric reports the PCIe replays and XGMI errors itself: no separate counters read.
COUNTERS: dict[str, tuple[str, ...]] = {}
COUNTER_PARSERS: dict[str, Callable[[str], LinkCounters]] = {}
KERNEL_LOG = None  # no XID-like kernel messages; RAS errors arrive as ECC counts below

# RAS: any uncorrectable ECC error drains the GPU (judged from the readings, like NVIDIA's ECC).
XID_CRITICAL: frozenset[int] = frozenset()
XID_WARNING: frozenset[int] = frozenset()

# Dense bf16 matrix peak per device (one GCD for MI250X), from the datasheets.
PEAK_BF16_FLOPS = {"MI250X": 191.5e12, "MI300X": 1307e12}
# Published single-node busbw of a 16 GiB all-reduce (rccl-tests), GB/s.
BUSBW_FLOORS_GBPS = {"MI300X": 314.0}


def _value(node: Any, *path: str) -> float | None:
    """A number at `path`, unwrapping amd-smi's {"value": x, "unit": u} objects."""
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    if isinstance(node, dict):
        node = node.get("value")
    return number(node)


# amd-smi metric's violation statuses ("throttle" in ROCm 6.2-6.3, "violation" later) onto the
# common reasons (readings.CLOCK_EVENT_REASONS): package power tracking is the power cap,
# socket/HBM/VR thermal limits are thermal slowdown, PROCHOT is a hardware slowdown.
VIOLATION_REASONS = {
    "ppt_violation_status": "sw_power_cap",
    "socket_thermal_violation_status": "hw_thermal_slowdown",
    "hbm_thermal_violation_status": "hw_thermal_slowdown",
    "vr_thermal_violation_status": "hw_thermal_slowdown",
    "prochot_violation_status": "hw_slowdown",
}
# The RAS block whose error counts are XGMI (GPU-to-GPU link) errors.
XGMI_BLOCK = "XGMI_WAFL"


def _clock_events(entry: dict[str, Any]) -> dict[str, float]:
    statuses = entry.get("violation") or entry.get("throttle")
    events: dict[str, float] = {}
    if isinstance(statuses, dict):
        for key, reason in VIOLATION_REASONS.items():
            state = active(statuses.get(key))
            if state is not None:
                events[reason] = max(state, events.get(reason, 0.0))
    power: dict[str, Any] = entry["power"] if isinstance(entry.get("power"), dict) else {}
    legacy = {"THROTTLED": 1.0, "UNTHROTTLED": 0.0}.get(power.get("throttle_status", ""))
    if "sw_power_cap" not in events and legacy is not None:
        events["sw_power_cap"] = legacy  # ROCm 6.0-6.1: power throttling only
    return events


def _xgmi_errors(entry: dict[str, Any]) -> dict[tuple[str, str], float]:
    block = (entry.get("ecc_blocks") or {}).get(XGMI_BLOCK) if isinstance(entry, dict) else None
    errors = {}
    for kind in ("correctable", "uncorrectable"):
        value = _value(block, kind + "_count")
        if value is not None:
            errors[("xgmi", kind + "_errors")] = value
    return errors


def _mib(node: Any, *path: str) -> float | None:
    # amd-smi prints VRAM in "MB" that are MiB (a 192 GiB MI300X reports 196592 MB).
    return scaled(_value(node, *path), MIB)


def parse_amd_smi(text: str) -> ParseResult:
    """Parse `amd-smi metric --json` (ROCm 6.x: a list of GPUs; 6.4+/7.x: {"gpu_data": [...]})."""
    try:
        data = json.loads(text)
    except ValueError as error:
        raise ToolError("amd-smi printed no JSON (" + str(error)[:80] + ")") from None
    entries = data.get("gpu_data") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ToolError("amd-smi JSON has neither a GPU list nor a gpu_data list")
    gpus, problems = [], []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("gpu"), int):
            problems.append("amd-smi entry without a GPU index: " + str(entry)[:120])
            continue
        temperature = _value(entry, "temperature", "hotspot")
        if temperature is None:
            temperature = _value(entry, "temperature", "edge")
        power = _value(entry, "power", "socket_power")
        if power is None:
            power = _value(entry, "power", "average_socket_power")
        gpus.append(
            GpuReading(
                gpu=str(entry["gpu"]),
                utilization_ratio=scaled(_value(entry, "usage", "gfx_activity"), 0.01),
                memory_used_bytes=_mib(entry, "mem_usage", "used_vram"),
                memory_total_bytes=_mib(entry, "mem_usage", "total_vram"),
                temperature_celsius=temperature,
                memory_temperature_celsius=_value(entry, "temperature", "mem"),
                power_watts=power,
                ecc_uncorrected_total=_value(entry, "ecc", "total_uncorrectable_count"),
                ecc_corrected_total=_value(entry, "ecc", "total_correctable_count"),
                pcie_replays_total=_value(entry, "pcie", "replay_count"),
                clock_events=_clock_events(entry),
                interconnect_errors=_xgmi_errors(entry),
            )
        )
    return ParseResult(gpus, problems)


def _first(card: dict[str, Any], *keys: str) -> float | None:
    for key in keys:
        value = number(card.get(key))
        if value is not None:
            return value
    return None


# The keys parse_rocm_smi reads: card keys, then the "system" key. tests/monitoring checks each
# against the real rocm-smi's source (Debian's rocm-smi 5.2.3).
ROCM_SMI_KEYS = {
    "use": "GPU use (%)",
    "vram_used": "VRAM Total Used Memory (B)",
    "vram_total": "VRAM Total Memory (B)",
    "temperature": "Temperature (Sensor junction) (C)",
    "temperature_fallback": "Temperature (Sensor edge) (C)",
    "memory_temperature": "Temperature (Sensor memory) (C)",
    "pcie_replays": "PCIe Replay Count",
    "power": "Average Graphics Package Power (W)",
    "power_limit": "Max Graphics Package Power (W)",
    "name": "Card series",
    "uuid": "Unique ID",
    "serial": "Serial Number",
    "driver": "Driver version",
}


def parse_rocm_smi(text: str) -> ParseResult:
    """Parse `rocm-smi --showallinfo --showmeminfo vram --json`: {"card0": {"GPU use (%)": "12",
    ...}, "system": {"Driver version": ...}}. Without a GPU it prints nothing on stdout."""
    try:
        data = json.loads(text[text.index("{") :] if "{" in text else text)
    except ValueError as error:
        raise ToolError("rocm-smi printed no JSON (" + str(error)[:80] + ")") from None
    if not isinstance(data, dict):
        raise ToolError("rocm-smi JSON is not an object keyed by card")
    key = ROCM_SMI_KEYS
    system = data["system"] if isinstance(data.get("system"), dict) else {}
    driver = text_or_none(system.get(key["driver"]))
    gpus, problems = [], []
    for card_key, card in data.items():
        match = re.fullmatch(r"card(\d+)", card_key)
        if not match:
            continue  # "system" holds driver versions
        if not isinstance(card, dict):
            problems.append("rocm-smi " + card_key + " is not an object")
            continue
        gpus.append(
            GpuReading(
                gpu=match.group(1),
                utilization_ratio=scaled(_first(card, key["use"]), 0.01),
                memory_used_bytes=_first(card, key["vram_used"]),
                memory_total_bytes=_first(card, key["vram_total"]),
                temperature_celsius=_first(card, key["temperature"], key["temperature_fallback"]),
                memory_temperature_celsius=_first(card, key["memory_temperature"]),
                pcie_replays_total=_first(card, key["pcie_replays"]),
                power_watts=_first(card, key["power"]),
                power_limit_watts=_first(card, key["power_limit"]),
                name=text_or_none(card.get(key["name"])),
                driver=driver,
                uuid=text_or_none(card.get(key["uuid"])),
                serial=text_or_none(card.get(key["serial"])),
            )
        )
    return ParseResult(gpus, problems)


PARSERS = {"amd-smi": parse_amd_smi, "rocm-smi": parse_rocm_smi}


def xid_events(kernel_log: str) -> dict[tuple[int, int, int], list[tuple[int, str]]]:
    return {}


def judge_xids(codes: list[int]) -> tuple[str, str]:
    return "OK", "no kernel-log rules for AMD (RAS errors are judged from ECC counts)"


# --- Read by the Ansible roles (plugins/lookup/rlm_vendor.py, plugins/filter/rlm_vendor.py) ---
PCI_VENDOR_ID = "1002"  # lspci -n (gpu_detect)
KERNEL_MODULE = "amdgpu"  # /sys/module/<name> exists while the driver is loaded
# Device nodes of the loaded driver: a control node and one node per GPU (a glob in `dir`).
DEVICE_FILES: DeviceFiles = {"control": "/dev/kfd", "dir": "/dev/dri", "per_gpu": "renderD*"}
# gres.conf File= (slurm role): render nodes start at 128, GPU n of the tool is renderD(128 + n).
GRES_FILES: GresFiles = {"prefix": "/dev/dri/renderD", "first": 128}
TOOLKIT_HOME = "/opt/rocm"
# rccl-tests at a pinned tag; built with `make` and these arguments ({toolkit}: TOOLKIT_HOME).
BANDWIDTH_TEST_SOURCE = ("https://github.com/ROCm/rccl-tests.git", "rocm-6.2.4")
BANDWIDTH_TEST_MAKE_ARGS = ("HIP_HOME={toolkit}", "NCCL_HOME={toolkit}")
NET_PLUGIN = "aws-ofi-rccl"  # RCCL over libfabric (Slingshot, EFA): comm_net_plugin
# The exporter of EXPORTER_JOB (gpu_exporter): its packages and services.
EXPORTER_PACKAGES = ("amdgpu-exporter",)
EXPORTER_SERVICES = ("amd-metrics-exporter",)
TORCH_INDEX_URL = "https://download.pytorch.org/whl/rocm6.2"
# Power caps (gpu_power): the query parse_power_limits reads and, per GPU ({gpu}, {watts}), the
# command setting the cap (no persistence mode); the boot unit runs after POWER_AFTER.
POWER_QUERY = ("amd-smi", "static", "--limit", "--json")
POWER_PERSISTENCE = None
POWER_SET = ("amd-smi", "set", "-g", "{gpu}", "--power-cap", "{watts}")
POWER_AFTER = "multi-user.target"


def _watts(node: Any) -> float | None:
    # {"value": 300, "unit": "W"} (6.3+) or "300 W" / "300.0 W" (older releases)
    if isinstance(node, dict):
        node = node.get("value")
    if isinstance(node, str):
        match = re.search(r"[0-9.]+", node)
        node = match.group(0) if match else None
    return number(node)


def parse_power_limits(text: str) -> list[dict[str, Any]]:
    """Each GPU's {index, min, max, current, default} cap in W from `amd-smi static --limit --json`
    (a list, ROCm 6.1/6.2, or {"gpu_data": [...]}, 6.3+). Instinct parts ship capped at their
    maximum: that is the default to revert to."""
    data = json.loads(text)
    gpus = []
    for entry in data.get("gpu_data", []) if isinstance(data, dict) else data:
        limit = entry.get("limit", {})
        low, high, current = (
            _watts(limit.get(key)) for key in ("min_power", "max_power", "socket_power")
        )
        gpus.append(
            {
                "index": int(entry["gpu"]),
                "min": low,
                "max": high,
                "current": current,
                "default": high,
                "persistence": "N/A",
            }
        )
    return gpus


# The GPUs' model for gres.conf Type= (clusterspec/binding.py): {"card0": {"Card series": ..}}.
NAME_QUERY = ("rocm-smi", "--showproductname", "--json")
BRAND_WORDS = frozenset({"AMD", "INSTINCT", "RADEON"})


def parse_names(text: str) -> list[str]:
    return [gpu.name or "" for gpu in parse_rocm_smi(text).gpus]


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

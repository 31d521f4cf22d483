"""GPU readings from the vendor command-line tools, for sites without dcgm/AMD exporters.

Each tool is run as a subprocess with a timeout and its output parsed into `GpuReading`s. Parsers
are pure functions so they can be tested against recorded tool output (tests/monitoring/fixtures).
A field the tool reports as unavailable (`[N/A]`, `N/A`, `[Not Supported]`) becomes None and its
series is simply not exported.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Any

MIB = 1024 * 1024

# nvidia-smi --query-gpu fields, in the order the CSV columns come back.
NVIDIA_FIELDS = (
    "index",
    "pci.bus_id",
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "power.draw",
    "enforced.power.limit",
    "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.corrected.volatile.total",
    "clocks_throttle_reasons.sw_power_cap",
)
NVIDIA_COMMAND = (
    "nvidia-smi",
    f"--query-gpu={','.join(NVIDIA_FIELDS)}",
    "--format=csv,noheader,nounits",
)
AMD_SMI_COMMAND = ("amd-smi", "metric", "--json")
ROCM_SMI_COMMAND = ("rocm-smi", "--showallinfo", "--json")
# The kernel ring buffer is where the NVIDIA driver reports XID events.
DMESG_COMMAND = ("dmesg",)

COMMANDS = {"nvidia-smi": NVIDIA_COMMAND, "amd-smi": AMD_SMI_COMMAND, "rocm-smi": ROCM_SMI_COMMAND}
# Auto-detection order: the newer AMD tool before the deprecated one.
SOURCES = ("nvidia-smi", "amd-smi", "rocm-smi")

_UNAVAILABLE = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]"}
# "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
_XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\): (\d+)")


class ToolError(Exception):
    """The tool could not be run, timed out, failed, or printed something we cannot read."""


@dataclass
class GpuReading:
    gpu: str  # index as the vendor tool numbers it
    utilization_ratio: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    ecc_uncorrected_total: float | None = None
    ecc_corrected_total: float | None = None
    power_throttled: float | None = None
    pci_bus: tuple[int, int, int] | None = field(default=None, repr=False)


@dataclass
class ParseResult:
    gpus: list[GpuReading]
    problems: list[str]  # rows or GPUs that could not be read; the rest is still usable


def _number(text: Any) -> float | None:
    if isinstance(text, bool):
        return None
    if isinstance(text, int | float):
        return float(text)
    if not isinstance(text, str) or text.strip().lower() in _UNAVAILABLE:
        return None
    try:
        return float(text.strip())
    except ValueError:
        return None


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _pci_key(domain: str, bus: str, device: str) -> tuple[int, int, int]:
    return int(domain, 16), int(bus, 16), int(device, 16)


def parse_nvidia_smi(text: str) -> ParseResult:
    """Parse `nvidia-smi --query-gpu=<NVIDIA_FIELDS> --format=csv,noheader,nounits`."""
    gpus, problems = [], []
    for row in csv.reader(line for line in text.splitlines() if line.strip()):
        cells = [cell.strip() for cell in row]
        if len(cells) != len(NVIDIA_FIELDS) or not cells[0].isdigit():
            problems.append(f"unreadable nvidia-smi line: {','.join(cells)[:120]}")
            continue
        values = dict(zip(NVIDIA_FIELDS, cells, strict=True))
        bus = re.fullmatch(
            r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.\d", values["pci.bus_id"]
        )
        throttle = values["clocks_throttle_reasons.sw_power_cap"].lower()
        gpus.append(
            GpuReading(
                gpu=values["index"],
                utilization_ratio=_scaled(_number(values["utilization.gpu"]), 0.01),
                memory_used_bytes=_scaled(_number(values["memory.used"]), MIB),
                memory_total_bytes=_scaled(_number(values["memory.total"]), MIB),
                temperature_celsius=_number(values["temperature.gpu"]),
                power_watts=_number(values["power.draw"]),
                power_limit_watts=_number(values["enforced.power.limit"]),
                ecc_uncorrected_total=_number(values["ecc.errors.uncorrected.volatile.total"]),
                ecc_corrected_total=_number(values["ecc.errors.corrected.volatile.total"]),
                power_throttled={"active": 1.0, "not active": 0.0}.get(throttle),
                pci_bus=_pci_key(*bus.groups()) if bus else None,
            )
        )
    return ParseResult(gpus, problems)


def _amd_value(node: Any, *path: str) -> float | None:
    """A number at `path`, unwrapping amd-smi's {"value": x, "unit": u} objects."""
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    if isinstance(node, dict):
        node = node.get("value")
    return _number(node)


def _amd_mib(node: Any, *path: str) -> float | None:
    # amd-smi prints VRAM in "MB" that are MiB (a 192 GiB MI300X reports 196592 MB).
    return _scaled(_amd_value(node, *path), MIB)


def parse_amd_smi(text: str) -> ParseResult:
    """Parse `amd-smi metric --json` (ROCm 6.x: a list of GPUs; 6.4+/7.x: {"gpu_data": [...]})."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ToolError(f"amd-smi printed no JSON ({error.msg} at line {error.lineno})") from None
    entries = data.get("gpu_data") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ToolError("amd-smi JSON has neither a GPU list nor a gpu_data list")
    gpus, problems = [], []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("gpu"), int):
            problems.append(f"amd-smi entry without a GPU index: {str(entry)[:120]}")
            continue
        throttle = entry.get("power", {}).get("throttle_status")
        temperature = _amd_value(entry, "temperature", "hotspot")
        if temperature is None:
            temperature = _amd_value(entry, "temperature", "edge")
        power = _amd_value(entry, "power", "socket_power")
        if power is None:
            power = _amd_value(entry, "power", "average_socket_power")
        gpus.append(
            GpuReading(
                gpu=str(entry["gpu"]),
                utilization_ratio=_scaled(_amd_value(entry, "usage", "gfx_activity"), 0.01),
                memory_used_bytes=_amd_mib(entry, "mem_usage", "used_vram"),
                memory_total_bytes=_amd_mib(entry, "mem_usage", "total_vram"),
                temperature_celsius=temperature,
                power_watts=power,
                ecc_uncorrected_total=_amd_value(entry, "ecc", "total_uncorrectable_count"),
                ecc_corrected_total=_amd_value(entry, "ecc", "total_correctable_count"),
                power_throttled={"THROTTLED": 1.0, "UNTHROTTLED": 0.0}.get(throttle),
            )
        )
    return ParseResult(gpus, problems)


def _first(card: dict[str, Any], *keys: str) -> float | None:
    for key in keys:
        value = _number(card.get(key))
        if value is not None:
            return value
    return None


def parse_rocm_smi(text: str) -> ParseResult:
    """Parse `rocm-smi --showallinfo --json`: {"card0": {"GPU use (%)": "12", ...}, "system": ...}."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ToolError(f"rocm-smi printed no JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict):
        raise ToolError("rocm-smi JSON is not an object keyed by card")
    gpus, problems = [], []
    for key, card in data.items():
        match = re.fullmatch(r"card(\d+)", key)
        if not match:
            continue  # "system" holds driver versions
        if not isinstance(card, dict):
            problems.append(f"rocm-smi {key} is not an object")
            continue
        gpus.append(
            GpuReading(
                gpu=match.group(1),
                utilization_ratio=_scaled(_first(card, "GPU use (%)"), 0.01),
                memory_used_bytes=_first(card, "VRAM Total Used Memory (B)"),
                memory_total_bytes=_first(card, "VRAM Total Memory (B)"),
                temperature_celsius=_first(
                    card, "Temperature (Sensor junction) (C)", "Temperature (Sensor edge) (C)"
                ),
                power_watts=_first(
                    card,
                    "Current Socket Graphics Package Power (W)",
                    "Average Graphics Package Power (W)",
                ),
                power_limit_watts=_first(card, "Max Graphics Package Power (W)"),
            )
        )
    return ParseResult(gpus, problems)


PARSERS = {"nvidia-smi": parse_nvidia_smi, "amd-smi": parse_amd_smi, "rocm-smi": parse_rocm_smi}


def count_xids(text: str) -> dict[tuple[int, int, int], list[str]]:
    """XID lines of a kernel log, grouped by the GPU's PCI (domain, bus, device)."""
    events: dict[tuple[int, int, int], list[str]] = {}
    for line in text.splitlines():
        match = _XID_RE.search(line)
        if match:
            events.setdefault(_pci_key(*match.groups()[:3]), []).append(line.strip())
    return events


@dataclass
class ToolOutput:
    stdout: str
    returncode: int
    stderr_tail: str


def run_tool(command: tuple[str, ...], timeout_s: float) -> ToolOutput:
    """Run `command`; ToolError when it is missing or outlives `timeout_s` (it is then killed).

    A non-zero exit is returned, not raised: nvidia-smi exits non-zero when one GPU has fallen
    off the bus but still prints the others, which are worth exporting.
    """
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # so a hung tool and anything it spawned can be killed together
        )
    except OSError as error:
        raise ToolError(f"cannot run {command[0]}: {error.strerror}") from None
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise ToolError(f"{command[0]} did not finish within {timeout_s:g} s") from None
    lines = err.decode(errors="replace").strip().splitlines()
    return ToolOutput(
        out.decode(errors="replace"), process.returncode, lines[-1][:200] if lines else ""
    )


def detect_source() -> str | None:
    """The first vendor tool found on PATH, or None on a node without GPUs or tools."""
    return next((name for name in SOURCES if shutil.which(name)), None)

"""What every vendor's GPU-tool parser returns, and the number helpers they share.

Standard library only and Python 3.8-compatible: `rlmctl health` ships this package to the hosts
inside its command line, and the exporter imports it as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

MIB = 1024 * 1024
# How the tools say "no value": the field's series is then not exported and not judged.
UNAVAILABLE = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]"}


class ToolError(Exception):
    """The tool could not be run, timed out, failed, or printed something we cannot read."""


# Why a GPU's clocks are held back, in one vocabulary for every vendor (NVIDIA's clocks event
# reasons; AMD's violation statuses map onto them): the label `reason` of rlm_gpu_clock_event.
# At full load a GPU sits at its power cap by design (sw_power_cap); the others are faults.
CLOCK_EVENT_REASONS = (
    "sw_power_cap",
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sw_thermal_slowdown",
)


@dataclass
class GpuReading:
    gpu: str  # index as the vendor tool numbers it
    utilization_ratio: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None  # HBM
    power_watts: float | None = None
    power_limit_watts: float | None = None
    ecc_uncorrected_total: float | None = None
    ecc_corrected_total: float | None = None
    row_remap_pending: float | None = None  # 1 while a remapped row waits for a GPU reset
    row_remap_failed: float | None = None  # 1 once a row remap has failed: the GPU is done
    pcie_replays_total: float | None = None
    clock_events: dict[str, float] = field(default_factory=dict)  # reason -> 1 active / 0 not
    # (link, counter) -> errors since the driver loaded: NVLink per link, XGMI
    interconnect_errors: dict[tuple[str, str], float] = field(default_factory=dict)
    name: str | None = None  # product name (the SKU the peak/floor tables are keyed by)
    driver: str | None = None
    uuid: str | None = None  # stable identity: the index can change after a GPU falls off
    serial: str | None = None  # board serial, what an RMA asks for
    pci_bus: tuple[int, int, int] | None = field(default=None, repr=False)


@dataclass
class ParseResult:
    gpus: list[GpuReading]
    problems: list[str]  # rows or GPUs that could not be read; the rest is still usable


@dataclass
class LinkCounters:
    """Link error counters read on their own, less often (vendor COUNTERS): PCIe replays per GPU
    PCI address, interconnect errors per GPU UUID and (link, counter)."""

    # (domain, bus, device) -> replays
    pcie_replays: dict[tuple[int, int, int], float] = field(default_factory=dict)
    # uuid -> {(link, counter): errors}
    interconnect_errors: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def number(text: Any) -> float | None:
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text)
    if not isinstance(text, str) or text.strip().lower() in UNAVAILABLE:
        return None
    try:
        return float(text.strip())
    except ValueError:
        return None


def scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def pci_key(domain: str, bus: str, device: str) -> tuple[int, int, int]:
    return int(domain, 16), int(bus, 16), int(device, 16)


def active(text: Any) -> float | None:
    """1.0 / 0.0 for the tools' "Active"/"Not Active", "Yes"/"No", "ACTIVE"/"NOT ACTIVE"."""
    if not isinstance(text, str):
        return None
    return {"active": 1.0, "not active": 0.0, "yes": 1.0, "no": 0.0}.get(text.strip().lower())


def snake(name: str) -> str:
    """ "Replay Errors" -> "replay_errors": a tool's counter name as a label value."""
    return "_".join(name.lower().replace("-", " ").split())


def text_or_none(value: Any) -> str | None:
    if not isinstance(value, str) or value.strip().lower() in UNAVAILABLE:
        return None
    return value.strip()


def by_sku(table: Mapping[str, T], device_name: str) -> tuple[T | None, str | None]:
    """(value, key) of the longest key of `table` contained in `device_name` (case-insensitive)."""
    upper = (device_name or "").upper()
    matches = [key for key in table if key.upper() in upper]
    if not matches:
        return None, None
    key = max(matches, key=len)
    return table[key], key

"""What every vendor's GPU-tool parser returns, and the number helpers they share.

Standard library only and Python 3.8-compatible: `rlmctl health` ships this package to the hosts
inside its command line, and the exporter imports it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MIB = 1024 * 1024
# How the tools say "no value": the field's series is then not exported and not judged.
UNAVAILABLE = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]"}


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
    name: str | None = None  # product name (the SKU the peak/floor tables are keyed by)
    driver: str | None = None
    uuid: str | None = None  # stable identity: the index can change after a GPU falls off
    serial: str | None = None  # board serial, what an RMA asks for
    pci_bus: tuple[int, int, int] | None = field(default=None, repr=False)


@dataclass
class ParseResult:
    gpus: list[GpuReading]
    problems: list[str]  # rows or GPUs that could not be read; the rest is still usable


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


def text_or_none(value: Any) -> str | None:
    if not isinstance(value, str) or value.strip().lower() in UNAVAILABLE:
        return None
    return value.strip()


def by_sku(table: dict, device_name: str) -> tuple[float | None, str | None]:
    """(value, key) of the longest key of `table` contained in `device_name` (case-insensitive)."""
    upper = (device_name or "").upper()
    matches = [key for key in table if key.upper() in upper]
    if not matches:
        return None, None
    key = max(matches, key=len)
    return table[key], key

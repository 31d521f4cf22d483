"""GPU readings from the vendor command-line tools, for sites without dcgm/AMD exporters.

What to run and how to read it comes from the vendor descriptions (clusterspec.vendors: one
command and one parser per tool, shared with rlmctl's health gate); this module runs the tool as a
subprocess with a timeout. A field the tool reports as unavailable (`[N/A]`, `N/A`,
`[Not Supported]`) becomes None and its series is simply not exported.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

from clusterspec import vendors
from clusterspec.vendors import nvidia
from clusterspec.vendors.readings import GpuReading, ParseResult, ToolError

__all__ = ["COMMANDS", "PARSERS", "SOURCES", "GpuReading", "ParseResult", "ToolError"]

# Tool name -> command and parser, in auto-detection order (newer AMD tool before rocm-smi).
COMMANDS = {tool: module.TOOLS[tool] for tool, module in vendors.tools().items()}
PARSERS = {tool: module.PARSERS[tool] for tool, module in vendors.tools().items()}
SOURCES = tuple(COMMANDS)
DMESG_COMMAND = nvidia.KERNEL_LOG


def count_xids(text: str) -> dict[tuple[int, int, int], list[str]]:
    """XID lines of a kernel log, grouped by the GPU's PCI (domain, bus, device)."""
    return {bus: [line for _, line in events] for bus, events in nvidia.xid_events(text).items()}


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
    return vendors.detect_tool()

"""GPU readings from the vendor command-line tools, for sites without dcgm/AMD exporters.

What to run and how to read it comes from the vendor descriptions (clusterspec.vendors: one
command and one parser per tool, shared with rlmctl's health gate); this module runs the tool as a
subprocess with a timeout. A field the tool reports as unavailable (`[N/A]`, `N/A`,
`[Not Supported]`) becomes None and its series is simply not exported.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass

import psutil

from clusterspec import vendors
from clusterspec.vendors.readings import GpuReading, LinkCounters, ParseResult, ToolError

__all__ = [
    "COMMANDS",
    "COUNTERS",
    "KERNEL_LOGS",
    "PARSERS",
    "SOURCES",
    "GpuReading",
    "LinkCounters",
    "ParseResult",
    "ToolError",
]

# Tool name -> command and parser, in auto-detection order (newer AMD tool before rocm-smi).
COMMANDS = {tool: module.TOOLS[tool] for tool, module in vendors.tools().items()}
PARSERS = {tool: module.PARSERS[tool] for tool, module in vendors.tools().items()}
SOURCES = tuple(COMMANDS)
# Tool name -> its link-counter command and parser (vendors whose tool does not report them).
COUNTERS = {
    tool: (module.COUNTERS[tool], module.COUNTER_PARSERS[tool])
    for tool, module in vendors.tools().items()
    if tool in module.COUNTERS
}
# Tool name -> its vendor's kernel-log command and XID reader (None where the vendor has none).
KERNEL_LOGS = {
    tool: (module.KERNEL_LOG, module.xid_events)
    for tool, module in vendors.tools().items()
    if module.KERNEL_LOG
}


@dataclass
class ToolOutput:
    stdout: str
    returncode: int
    stderr_tail: str


def run_tool(command: tuple[str, ...], timeout_s: float, name: str | None = None) -> ToolOutput:
    """Run `command`; ToolError when it is missing or outlives `timeout_s`.

    A hung tool is killed with everything it started (its session, and any child that left it)
    and reaped, without waiting for its pipes: a child that escaped the kill may hold them open.
    A non-zero exit is returned, not raised: nvidia-smi exits non-zero when one GPU has fallen
    off the bus but still prints the others, which are worth exporting.
    """
    name = name or command[0]
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # so a hung tool and anything it spawned can be killed together
        )
    except OSError as error:
        raise ToolError(f"cannot run {name}: {error.strerror}") from None
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        raise ToolError(f"{name} did not finish within {timeout_s:g} s") from None
    lines = err.decode(errors="replace").strip().splitlines()
    return ToolOutput(
        out.decode(errors="replace"), process.returncode, lines[-1][:200] if lines else ""
    )


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL `process`, its process group and its descendants; reap it; close its pipes."""
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        children = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    for pipe in (process.stdout, process.stderr):
        if pipe:
            pipe.close()
    process.wait(timeout=5)  # SIGKILL cannot be ignored: this returns at once
    psutil.wait_procs(children, timeout=1)


def detect_source() -> str | None:
    """The first installed tool of a vendor whose driver is loaded (vendors.detect_tool), or None
    on a node without GPUs."""
    return vendors.detect_tool()

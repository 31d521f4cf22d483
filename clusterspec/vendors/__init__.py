"""One description per GPU vendor (stdlib only, Python 3.8): `nvidia`, `amd`.

A vendor module defines NAME, TOOLS (tool -> command, in detection order), PARSERS (tool -> the
one parser of its output, returning readings.ParseResult), KERNEL_LOG, xid_events/judge_xids,
PEAK_BF16_FLOPS and BUSBW_FLOORS_GBPS per SKU, TOPOLOGY (the topology command, parser and
expected GPU link per SKU), TORCH_DEVICE and DIST_BACKEND. The health gate
(rlmctl/hostcheck.py, shipped to hosts with this package), `rlmctl health --deep`, the exporter
(monitoring/gpu.py) and the trainer's MFU (trainer/flops.py) read only these. Adding a vendor:
docs/architecture.md, "A new GPU vendor".
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from types import ModuleType

from clusterspec.vendors import amd, nvidia
from clusterspec.vendors.readings import by_sku

VENDORS: dict[str, ModuleType] = {"nvidia": nvidia, "amd": amd}


def tools() -> dict[str, ModuleType]:
    """Every GPU tool -> its vendor, in detection order."""
    return {tool: module for module in VENDORS.values() for tool in module.TOOLS}


def tool_of(tool: str) -> ModuleType:
    return tools()[tool]


def detect_tool(which: Callable[[str], str | None] = shutil.which) -> str | None:
    """The first vendor tool found on PATH, or None on a node without GPUs or tools."""
    return next((tool for tool in tools() if which(tool)), None)


def detect_vendor(which: Callable[[str], str | None] = shutil.which) -> str:
    """rlm_gpu_vendor=auto: the vendor whose tool is installed; "none" without any."""
    tool = detect_tool(which)
    return tools()[tool].NAME if tool else "none"


def vendor_tool(vendor: str, which: Callable[[str], str | None] = shutil.which) -> str:
    """The tool to read `vendor`'s GPUs with: the first installed one, else the preferred one."""
    candidates = list(VENDORS[vendor].TOOLS)
    return next((tool for tool in candidates if which(tool)), candidates[0])


def _lookup(attribute: str, device_name: str) -> tuple[float | None, str | None]:
    for module in VENDORS.values():
        value, key = by_sku(getattr(module, attribute), device_name)
        if value is not None:
            return value, key
    return None, None


def peak_bf16_flops(device_name: str) -> tuple[float | None, str | None]:
    """(dense bf16 FLOP/s, matched SKU) of a device name such as torch.cuda.get_device_name()."""
    return _lookup("PEAK_BF16_FLOPS", device_name)


def busbw_floor_gbps(device_name: str) -> float | None:
    return _lookup("BUSBW_FLOORS_GBPS", device_name)[0]


def expected_gpu_link(vendor: str, device_name: str) -> tuple[str | None, str | None]:
    """(link every GPU pair must have, matched SKU) for `vendor`'s device name; (None, None)
    for a SKU the vendor description does not know."""
    value, key = by_sku(VENDORS[vendor].TOPOLOGY.GPU_LINKS, device_name)
    return value, key


def golive_tflops(device_name: str) -> tuple[float | None, str | None]:
    """(go-live TFLOP/s per GPU, how it was chosen) for a device name; (None, None) for a SKU
    without a datasheet peak (CPU, unknown GPU)."""
    from clusterspec.vendors import golive

    value, key = by_sku(golive.TFLOPS_PER_GPU, device_name)
    if value is not None:
        return value, f"{key} go-live figure"
    peak, key = peak_bf16_flops(device_name)
    if peak is None:
        return None, None
    return round(peak / 1e12 * golive.DEFAULT_MFU, 1), f"{golive.DEFAULT_MFU:.0%} of {key} peak"

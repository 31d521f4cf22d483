"""One description per GPU vendor (stdlib only, Python 3.8): `nvidia`, `amd`.

A vendor module ends with DESCRIPTION, a description.Vendor: its tools and their parsers, XID
rules, peaks and floors per SKU, topology, torch device and backend, and the facts the Ansible
roles read (description.py lists and types every field). The health gate (rlmctl/hostcheck.py,
shipped to hosts with this package), `rlmctl health --deep`, the exporter (monitoring/gpu.py),
the trainer's MFU (trainer/flops.py), CPU binding (clusterspec/binding.py) and the roles
(plugins/) read only VENDORS. Adding a vendor: docs/architecture.md, "A new GPU vendor".
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from clusterspec.vendors import amd, nvidia
from clusterspec.vendors.description import Vendor
from clusterspec.vendors.readings import by_sku

VENDORS: dict[str, Vendor] = {"nvidia": nvidia.DESCRIPTION, "amd": amd.DESCRIPTION}
# /sys/module/<KERNEL_MODULE> exists while a vendor's driver is loaded: that, not an installed
# tool, makes a GPU node (ROCm's rocm-smi and amd-smi are installed on login nodes and in images
# without GPUs too). Tests point it at a directory of their own, as they put stand-in tools on PATH.
SYS_MODULE = Path("/sys/module")


def tools() -> dict[str, Vendor]:
    """Every GPU tool -> its vendor, in detection order."""
    return {tool: vendor for vendor in VENDORS.values() for tool in vendor.TOOLS}


def tool_of(tool: str) -> Vendor:
    return tools()[tool]


def driver_loaded(vendor: str) -> bool:
    """Whether `vendor`'s kernel driver is loaded on this host."""
    return (SYS_MODULE / VENDORS[vendor].KERNEL_MODULE).is_dir()


def detect_tool(which: Callable[[str], str | None] = shutil.which) -> str | None:
    """The first installed tool of a vendor whose driver is loaded; None on a node without GPUs
    (or whose driver is loaded but none of its tools installed)."""
    return next(
        (tool for tool, vendor in tools().items() if driver_loaded(vendor.NAME) and which(tool)),
        None,
    )


def detect_vendor() -> str:
    """rlm_gpu_vendor=auto: the vendor whose driver is loaded; "none" without any. A loaded driver
    without its tools is still that vendor's node, and the GPU check says the tool is missing."""
    return next((name for name in VENDORS if driver_loaded(name)), "none")


def vendor_tool(vendor: str, which: Callable[[str], str | None] = shutil.which) -> str:
    """The tool to read `vendor`'s GPUs with: the first installed one, else the preferred one."""
    candidates = list(VENDORS[vendor].TOOLS)
    return next((tool for tool in candidates if which(tool)), candidates[0])


def _lookup(
    table: Callable[[Vendor], Mapping[str, float]], device_name: str
) -> tuple[float | None, str | None]:
    for vendor in VENDORS.values():
        value, key = by_sku(table(vendor), device_name)
        if value is not None:
            return value, key
    return None, None


def peak_bf16_flops(device_name: str) -> tuple[float | None, str | None]:
    """(dense bf16 FLOP/s, matched SKU) of a device name such as torch.cuda.get_device_name()."""
    return _lookup(lambda vendor: vendor.PEAK_BF16_FLOPS, device_name)


def busbw_floor_gbps(device_name: str) -> float | None:
    return _lookup(lambda vendor: vendor.BUSBW_FLOORS_GBPS, device_name)[0]


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

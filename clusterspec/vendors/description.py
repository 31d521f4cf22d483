"""The shape of a GPU vendor description (stdlib only, Python 3.8).

Each vendor module (nvidia.py, amd.py) ends with `DESCRIPTION = Vendor(...)`, naming every field
below; its topology module with `TOOL = TopologyTool(...)`. A field a vendor leaves out is a
missing argument: mypy reports it (make lint) and the import fails on the hosts too. The fields
keep the names the modules' constants have, so `VENDORS[name].TOOLS` reads as `nvidia.TOOLS`.
Everything outside clusterspec/vendors reads vendors through these fields only (VENDORS).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from clusterspec.vendors.readings import LinkCounters, ParseResult
from clusterspec.vendors.topology import Topology


class DeviceFiles(TypedDict):
    """Device nodes of a loaded driver: a control node and one node per GPU (a glob in `dir`)."""

    control: str
    dir: str
    per_gpu: str


class GresFiles(TypedDict):
    """gres.conf File= of a node's GPUs: prefix + (first + n) for GPU n of the vendor's tool."""

    prefix: str
    first: int


@dataclass(frozen=True)
class TopologyTool:
    COMMAND: tuple[str, ...]  # prints the GPU x GPU (and GPU x NIC) matrix
    # The link every GPU pair of a healthy node has, per SKU (longest matching key wins).
    GPU_LINKS: Mapping[str, str]
    parse: Callable[[str], Topology]  # links, NIC paths, NUMA nodes: the health gate's verdict
    # The same output read for CPU binding: GPUs, their NUMA node and/or CPU affinity only.
    locality: Callable[[str], Topology]


@dataclass(frozen=True)
class Vendor:
    NAME: str
    # torch: device type and distributed backend (ROCm builds keep "cuda" and map "nccl" to RCCL).
    TORCH_DEVICE: str
    DIST_BACKEND: str
    # Tool name -> the command whose output PARSERS[tool] reads; detection order.
    TOOLS: Mapping[str, tuple[str, ...]]
    PARSERS: Mapping[str, Callable[[str], ParseResult]]
    # Link error counters read less often, per tool (empty where the tool reports them itself).
    COUNTERS: Mapping[str, tuple[str, ...]]
    COUNTER_PARSERS: Mapping[str, Callable[[str], LinkCounters]]
    # The kernel log command and the XID rules read from it (None: no kernel-log rules).
    KERNEL_LOG: tuple[str, ...] | None
    XID_CRITICAL: frozenset[int]
    XID_WARNING: frozenset[int]
    xid_events: Callable[[str], dict[tuple[int, int, int], list[tuple[int, str]]]]
    judge_xids: Callable[[list[int]], tuple[str, str]]
    # Per SKU (longest matching key wins): dense bf16 peak, single-node all-reduce busbw floor.
    PEAK_BF16_FLOPS: Mapping[str, float]
    BUSBW_FLOORS_GBPS: Mapping[str, float]
    BANDWIDTH_TEST: str  # the all_reduce_perf binary of nccl-tests / rccl-tests
    TOPOLOGY: TopologyTool
    # The GPUs' model (gres.conf Type=): the query, its parser, and the words of a model name that
    # only say the vendor ("NVIDIA L40S" -> l40s).
    NAME_QUERY: tuple[str, ...]
    parse_names: Callable[[str], list[str]]
    BRAND_WORDS: frozenset[str]
    # The vendor's own exporter (gpu_exporter role): Prometheus job name and port (file_sd).
    EXPORTER_JOB: tuple[str, int]
    # Read by the Ansible roles (plugins/lookup/rlm_vendor.py, plugins/filter/rlm_vendor.py).
    PCI_VENDOR_ID: str  # lspci -n (gpu_detect)
    KERNEL_MODULE: str  # /sys/module/<name> exists while the driver is loaded
    DEVICE_FILES: DeviceFiles
    GRES_FILES: GresFiles  # the slurm role's gres.conf
    TOOLKIT_HOME: str
    # The bandwidth test's (repository, tag) and its `make` arguments ({toolkit}: TOOLKIT_HOME).
    BANDWIDTH_TEST_SOURCE: tuple[str, str]
    BANDWIDTH_TEST_MAKE_ARGS: tuple[str, ...]
    NET_PLUGIN: str  # the libfabric network plugin of its collectives (comm_net_plugin)
    EXPORTER_PACKAGES: tuple[str, ...]
    EXPORTER_SERVICES: tuple[str, ...]
    TORCH_INDEX_URL: str
    # Power caps (gpu_power): the query parse_power_limits reads, then per GPU ({gpu}, {watts}) the
    # command enabling persistence mode (None: none) and the one setting the cap; the boot unit
    # runs after POWER_AFTER.
    POWER_QUERY: tuple[str, ...]
    POWER_PERSISTENCE: tuple[str, ...] | None
    POWER_SET: tuple[str, ...]
    POWER_AFTER: str
    parse_power_limits: Callable[[str], list[dict[str, Any]]]

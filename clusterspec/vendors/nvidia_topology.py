"""NVIDIA GPU topology: `nvidia-smi topo -m` and the expected GPU-to-GPU link per SKU.

Stdlib only, Python 3.8 (shipped to the hosts with the rest of clusterspec.vendors). Referenced
from the vendor description as nvidia.TOPOLOGY.
"""

from __future__ import annotations

import re

from clusterspec.vendors.description import TopologyTool
from clusterspec.vendors.readings import ToolError
from clusterspec.vendors.topology import ANY, Topology

COMMAND = ("nvidia-smi", "topo", "-m")

# The link every GPU pair of a node has when healthy (longest matching SKU key wins): HGX/DGX
# H100/H200 and GB200 reach every peer through NVSwitch with 18 NVLinks, DGX A100 with 12; PCIe
# cards (and NVL pairs bridged two by two) have no all-pairs NVLink to expect.
GPU_LINKS = {
    "A100": "NV12",
    "A100-PCIE": ANY,
    "H100": "NV18",
    "H100 PCIe": ANY,
    "H100 NVL": ANY,
    "H200": "NV18",
    "H200 NVL": ANY,
    "GB200": "NV18",
    "B200": "NV18",
}

_DEVICE = re.compile(r"(GPU\d+|NIC\d+|mlx\d+_\d+|[a-z]+\d+_\d+)$")
_CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def parse(text: str) -> Topology:
    """The GPU rows of `nvidia-smi topo -m`: GPU x GPU links, GPU -> NIC paths (NICs named by
    the "NIC Legend" where printed), NUMA affinity. Tab- or space-separated, any NIC count."""
    lines = text.splitlines()
    header_at = next((i for i, line in enumerate(lines) if re.match(r"\s+GPU0\b", line)), None)
    if header_at is None:
        raise ToolError("nvidia-smi topo -m printed no GPU matrix (no GPU0 column)")
    columns = []
    for word in lines[header_at].split():
        if not _DEVICE.match(word):
            break  # CPU Affinity, NUMA Affinity, GPU NUMA ID
        columns.append(word)
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, re.M))
    # After the devices: CPU Affinity, then NUMA Affinity (older drivers: NUMA, or nothing),
    # then GPU NUMA ID. Run inside a cpuset (a Slurm job), the CPU Affinity of a GPU whose CPUs
    # are all outside it is printed empty: its row is one cell short.
    trailing = _trailing_columns(lines[header_at][lines[header_at].index(columns[-1]) :])
    gpus = [c[3:] for c in columns if c.startswith("GPU")]
    links: dict[tuple[str, str], str] = {}
    nic_paths: dict[str, dict[str, str]] = {}
    numa: dict[str, str] = {}
    cpu_affinity: dict[str, str] = {}
    for line in lines[header_at + 1 :]:
        words = line.split()
        if not words or not re.fullmatch(r"GPU\d+", words[0]):
            continue
        gpu, cells = words[0][3:], words[1:]
        if len(cells) < len(columns):
            raise ToolError(f"nvidia-smi topo -m row {words[0]} has {len(cells)} cells")
        for column, cell in zip(columns, cells):
            if column.startswith("GPU"):
                peer = column[3:]
                if peer != gpu:
                    key = (gpu, peer) if int(gpu) < int(peer) else (peer, gpu)
                    links.setdefault(key, cell)
                    if links[key] != cell:  # asymmetric: keep the worse one visible
                        links[key] = min(links[key], cell, key=_rank)
            else:
                nic_paths.setdefault(legend.get(column, column), {})[gpu] = cell
        rest = cells[len(columns) :]
        named = trailing[len(trailing) - len(rest) :] if len(rest) < len(trailing) else trailing
        values = dict(zip(named, rest))
        if _CPU_LIST.fullmatch(values.get("cpu", "")):
            cpu_affinity[gpu] = values["cpu"]
        if values.get("numa", "").isdigit():
            numa[gpu] = values["numa"]
    if not gpus or (not links and len(gpus) > 1):
        raise ToolError("nvidia-smi topo -m printed no GPU rows")
    return Topology(
        gpus=gpus, links=links, nic_paths=nic_paths, numa=numa, cpu_affinity=cpu_affinity
    )


def _trailing_columns(header_tail: str) -> list[str]:
    """The kinds of the columns after the device columns, in order: "cpu", "numa", "gpu_numa"."""
    out = []
    for name, kind in (("CPU Affinity", "cpu"), ("NUMA", "numa"), ("GPU NUMA ID", "gpu_numa")):
        at = header_tail.find(name)
        if at >= 0 and not (kind == "numa" and header_tail[at:].startswith("NUMA ID")):
            out.append((at, kind))
    return [kind for _, kind in sorted(out)]


def _rank(cell: str) -> int:
    bond = re.fullmatch(r"NV(\d+)", cell)
    return 100 + int(bond.group(1)) if bond else -len(cell)


TOOL = TopologyTool(COMMAND=COMMAND, GPU_LINKS=GPU_LINKS, parse=parse, locality=parse)

"""AMD GPU topology: `rocm-smi --showtopo` and the expected GPU-to-GPU link per SKU.

Stdlib only, Python 3.8 (shipped to the hosts with the rest of clusterspec.vendors). Referenced
from the vendor description as amd.TOPOLOGY. rocm-smi reports no NICs, so only the GPU links
are judged. Its "Hops" matrix is 1 for every xGMI-connected pair even when the path is not a
direct link (ROCm/rocm-systems#5763), so the link *type* is what is compared; on MI250X every GCD
pair of a node is XGMI (the number of xGMI links between GCDs differs, which the weights show).
"""

from __future__ import annotations

import re

from clusterspec.vendors.readings import ToolError
from clusterspec.vendors.topology import Topology

COMMAND = ("rocm-smi", "--showtopo")

GPU_LINKS = {"MI250X": "XGMI", "MI300X": "XGMI", "MI325X": "XGMI"}


def _matrix(text: str, title: str) -> dict:
    """{(row, column): cell} of one "<title> between two GPUs" block."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if title in line), None)
    if start is None:
        return {}
    header = lines[start + 1].split()
    cells = {}
    for line in lines[start + 2 :]:
        words = line.split()
        if not words or not re.fullmatch(r"GPU\d+", words[0]):
            break
        for column, cell in zip(header, words[1:]):
            cells[(words[0][3:], column[3:])] = cell
    return cells


def parse(text: str) -> Topology:
    """The "Link Type between two GPUs" matrix (XGMI, PCIE) and the NUMA nodes of --showtopo."""
    types = _matrix(text, "Link Type between two GPUs")
    if not types:
        why = "nothing" if not text.strip() else "no Link Type matrix"
        raise ToolError(f"rocm-smi --showtopo printed {why} (is the amdgpu driver loaded?)")
    gpus = sorted({a for a, _ in types}, key=int)
    links = {(a, b): cell for (a, b), cell in types.items() if int(a) < int(b)}
    numa = dict(re.findall(r"GPU\[(\d+)\]\s*: \(Topology\) Numa Node: (\d+)", text))
    return Topology(gpus=gpus, links=links, numa=numa)

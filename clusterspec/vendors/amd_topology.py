"""AMD GPU topology: `rocm-smi --showtopo` and the expected GPU-to-GPU link per SKU.

Stdlib only, Python 3.8 (shipped to the hosts with the rest of clusterspec.vendors). Referenced
from the vendor description as amd.TOPOLOGY. rocm-smi reports no NICs, so only the GPU links
are judged. Its "Hops" matrix is 1 for every xGMI-connected pair even when the path is not a
direct link (ROCm/rocm-systems#5763, open-mpi/hwloc#775), so the link type and the "Weight"
matrix are read: 15 for a direct xGMI link, 30/45 through one/two other GCDs. rocm-smi does not
print how many xGMI lanes a direct pair has (MI250X's in-package GCD pair has 4 links, pairs
across packages 1 or 2; both weigh 15), so a GCD's direct peers are what is counted.

Expected layout per SKU: MI250X (HPE Cray EX235a, Frontier/LUMI: 4 OAMs, 8 GCDs) has every
pair XGMI and each GCD directly linked to 3 others, as in the recorded weights
(tests/rlmctl/fixtures/topology/rocm-smi-showtopo-mi250x-8gcd.txt): XGMI3. MI300X/MI325X (8
fully connected GPUs) are judged on the link type only.

`amd-smi topology` is not read: no published output of it from a real machine could be recorded
as a fixture (docs/acceptance.md, "GPU topology on AMD hosts").
"""

from __future__ import annotations

import re

from clusterspec.vendors.description import TopologyTool
from clusterspec.vendors.readings import ToolError
from clusterspec.vendors.topology import Topology

COMMAND = ("rocm-smi", "--showtopo")

GPU_LINKS = {"MI250X": "XGMI3", "MI300X": "XGMI", "MI325X": "XGMI"}


def _matrix(text: str, title: str) -> dict[tuple[str, str], str]:
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
    """The "Link Type between two GPUs" (XGMI, PCIE) and "Weight between two GPUs" matrices and
    the NUMA nodes of --showtopo."""
    types = _matrix(text, "Link Type between two GPUs")
    weights = {
        pair: int(cell)
        for pair, cell in _matrix(text, "Weight between two GPUs").items()
        if cell.isdigit()
    }
    if not types and not weights:
        why = "nothing" if not text.strip() else "no Link Type or Weight matrix"
        raise ToolError(f"rocm-smi --showtopo printed {why} (is the amdgpu driver loaded?)")
    gpus = sorted({a for a, _ in {**weights, **types}}, key=int)
    numa = dict(re.findall(r"GPU\[(\d+)\]\s*: \(Topology\) Numa Node: (\d+)", text))
    return Topology(
        gpus=gpus,
        links={(a, b): cell for (a, b), cell in types.items() if int(a) < int(b)},
        numa=numa,
        weights={(a, b): w for (a, b), w in weights.items() if int(a) < int(b)},
    )


def numa_affinity(text: str) -> dict[str, str]:
    """GPU -> the NUMA node of the CPUs nearest it, from the "Numa Nodes" block that both
    `rocm-smi --showtopo` and `--showtoponuma` print: "Numa Affinity" (the node the kernel gives
    the GPU's CPUs), else "Numa Node". rocm-smi prints an unsigned value: 4294967295 (-1) on a
    platform without NUMA information, which is left out (no CPUs are nearer than others)."""
    out = {}
    for label in ("Numa Node", "Numa Affinity"):  # the later one wins
        for gpu, node in re.findall(r"GPU\[(\d+)\]\s*: \(Topology\) " + label + r": (\d+)", text):
            if int(node) < 2**31:
                out[gpu] = node
    return out


def _locality(text: str) -> Topology:
    """The GPUs and their NUMA node (numa_affinity): all CPU binding needs; rocm-smi prints no
    CPU affinity."""
    numa = numa_affinity(text)
    return Topology(gpus=sorted(numa, key=int), links={}, numa=numa)


TOOL = TopologyTool(COMMAND=COMMAND, GPU_LINKS=GPU_LINKS, parse=parse, locality=_locality)

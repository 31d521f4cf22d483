"""A node's GPU topology and its verdict (stdlib only, Python 3.8): shared by every vendor.

Each vendor's topology module (nvidia_topology, amd_topology: the command, its parser and the
expected GPU-to-GPU link per SKU) turns its tool's output into a Topology: the link between
every GPU pair as the tool names it, and the PCIe path from each GPU to each NIC where the tool
reports NICs. `judge` compares it with the expected link: a pair below it is CRIT (an NVLink or
xGMI link down silently sends the traffic over PCIe and the CPU interconnect), a GPU whose
nearest NIC is across the CPU socket is WARN (GPUDirect RDMA then crosses the SMP link).

xGMI: every pair of a hive is typed XGMI and rocm-smi's hop count is 1 for all of them, even
where the path runs through another GCD, so a down xGMI link does not change the link type.
Its weight does (the direct xGMI weight, 15 from amdkfd, times the xGMI hops), so
`XGMI<n>` expects every pair XGMI and every GPU with at least n direct (lowest-weight) xGMI
peers; a pair of GPUs both short of peers and not directly linked is named as the lost link.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# nvidia-smi's PCIe path classes, nearest first; SYS crosses the SMP interconnect (QPI/UPI/xGMI
# between sockets), i.e. the device is on the far socket.
PCIE_PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS")
FAR_SOCKET = "SYS"
# An expected link that judges nothing (PCIe-only SKUs, or a site that opts out).
ANY = "any"


@dataclass
class Topology:
    gpus: list[str]  # GPU indices as the tool numbers them
    links: dict[tuple[str, str], str]  # (a, b) with a before b -> link as printed: NV18, SYS, XGMI
    nic_paths: dict[str, dict[str, str]] = field(default_factory=dict)  # NIC -> GPU -> path
    numa: dict[str, str] = field(default_factory=dict)  # GPU -> NUMA node, where printed
    # GPU -> the CPUs near it as printed ("0-55,112-167"), where printed (nvidia-smi's CPU Affinity)
    cpu_affinity: dict[str, str] = field(default_factory=dict)
    weights: dict[tuple[str, str], int] = field(default_factory=dict)  # (a, b): rocm-smi weight

    def as_dict(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "links": {f"{a}-{b}": link for (a, b), link in sorted(self.links.items())},
            "nic_paths": self.nic_paths,
            "numa": self.numa,
            "cpu_affinity": self.cpu_affinity,
            "weights": {f"{a}-{b}": w for (a, b), w in sorted(self.weights.items())},
        }


def link_meets(seen: str, expected: str) -> bool:
    """Whether a link as printed (NV18, NV6, SYS, XGMI, PCIE) is at least the expected one:
    NV<n> needs an NVLink bond of n or more links, NV any NVLink, anything else that exact type."""
    if expected.lower() == ANY:
        return True
    if re.fullmatch(r"XGMI\d+", expected.upper()):
        return seen.upper() == "XGMI"
    wanted = re.fullmatch(r"NV(\d*)", expected.upper())
    if wanted:
        bond = re.fullmatch(r"NV(\d+)", seen.upper())
        return bond is not None and int(bond.group(1)) >= int(wanted.group(1) or 1)
    return seen.upper() == expected.upper()


def degraded_pairs(topology: Topology, expected: str) -> list[str]:
    """'GPU2-GPU5 SYS' for every pair whose link is below `expected`, then the xGMI links lost
    under an `XGMI<n>` expectation."""
    below = [
        f"GPU{a}-GPU{b} {link}"
        for (a, b), link in sorted(topology.links.items(), key=lambda item: _order(item[0]))
        if not link_meets(link, expected)
    ]
    return below + missing_xgmi_links(topology, expected)


def missing_xgmi_links(topology: Topology, expected: str) -> list[str]:
    """Under `XGMI<n>` with a weight matrix: 'GPU0-GPU2 weight 30, not direct (...)' for each
    non-direct pair of two GPUs with fewer than n direct xGMI peers; a short GPU without such a
    partner is named alone."""
    wanted = re.fullmatch(r"XGMI(\d+)", expected.upper())
    weights = {
        pair: w
        for pair, w in topology.weights.items()
        if topology.links.get(pair, "XGMI") == "XGMI"
    }
    if not wanted or not weights:
        return []
    peers_wanted, direct = int(wanted.group(1)), min(weights.values())
    peers = {gpu: 0 for gpu in topology.gpus}
    for (a, b), weight in weights.items():
        if weight == direct:
            peers[a] += 1
            peers[b] += 1
    short = {gpu for gpu, count in peers.items() if count < peers_wanted}
    named: set[str] = set()
    out = []
    for (a, b), weight in sorted(weights.items(), key=lambda item: _order(item[0])):
        if weight != direct and a in short and b in short:
            named |= {a, b}
            out.append(
                f"GPU{a}-GPU{b} weight {weight}, not direct (GPU{a} has {peers[a]}, GPU{b} "
                f"{peers[b]} of {peers_wanted} direct xGMI peers)"
            )
    out += [
        f"GPU{gpu}: {peers[gpu]} of {peers_wanted} direct xGMI peers"
        for gpu in sorted(short - named, key=int)
    ]
    return out


def far_nics(topology: Topology) -> list[str]:
    """'GPU0: nearest NIC mlx5_0 is SYS' for every GPU whose every NIC is on the far socket."""
    if not topology.nic_paths:
        return []
    out = []
    for gpu in topology.gpus:
        paths = {nic: by_gpu[gpu] for nic, by_gpu in topology.nic_paths.items() if gpu in by_gpu}
        if not paths:
            continue
        nic, path = min(paths.items(), key=lambda item: _path_rank(item[1]))
        if path == FAR_SOCKET:
            out.append(f"GPU{gpu}: nearest NIC {nic} is {path}")
    return out


def judge(topology: Topology, expected: str | None, sku: str | None) -> tuple[str, str, str]:
    """(state, detail, fix): CRIT on a link below `expected` (pairs named), WARN on NICs across
    the socket, UNKNOWN when no expected link is known for the SKU."""
    count = len(topology.gpus)
    degraded = degraded_pairs(topology, expected) if expected else []
    far = far_nics(topology)
    nics = f", {len(topology.nic_paths)} NICs" if topology.nic_paths else ""
    pairs = max(len(topology.links), len(topology.weights))
    if degraded:
        shown = "; ".join(degraded[:6]) + (
            f" (+{len(degraded) - 6} more)" if len(degraded) > 6 else ""
        )
        return (
            "CRIT",
            f"{len(degraded)} of {pairs} GPU pairs below {expected}: {shown}",
            "a GPU link is down (traffic falls back to PCIe/SMP): reseat/check NVLink or xGMI "
            "and the fabric manager; drain the host meanwhile",
        )
    if far:
        return (
            "WARN",
            f"{count} GPUs{nics}; NIC on the far socket: " + "; ".join(far[:4]),
            "move the NIC or GPU to the same socket/PCIe switch, or pin NCCL_IB_HCA per rank",
        )
    if not expected:
        return (
            "UNKNOWN",
            f"{count} GPUs{nics}; links not judged: no expected layout for {sku or 'this GPU'}",
            "set rlm_gpu_link for this inventory group (e.g. NV18, XGMI, or any)",
        )
    links = f"every pair {expected}" if expected.lower() != ANY else "links not gated (any)"
    xgmi = re.fullmatch(r"XGMI(\d+)", expected.upper())
    if xgmi:
        links = f"every pair XGMI, each GPU with {xgmi.group(1)}+ direct xGMI peers"
    return "OK", f"{count} GPUs{nics}, {links}", ""


def _order(pair: tuple[str, str]) -> tuple[int, int]:
    a, b = (int(x) if x.isdigit() else 0 for x in pair)
    return a, b


def _path_rank(path: str) -> int:
    if re.fullmatch(r"NV\d+", path):
        return -1
    return PCIE_PATHS.index(path) if path in PCIE_PATHS else len(PCIE_PATHS)

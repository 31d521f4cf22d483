"""The communication path NCCL/RCCL chose, read from its NCCL_DEBUG=INFO log (stdlib only).

One place for: the debug environment the bandwidth tests and the trainer run with, the inventory's
fabric settings turned into NCCL variables (RoCE: GID index, traffic class, HCA list), the parser
of the log (transport per channel: NET/IB/<dev>[/GDRDMA], NET/IBext..., NET/Socket, P2P, SHM,
NVLS; the NICs NCCL says it uses) and the verdict against the expected fabric. Used by
`rlmctl health --deep` (rlmctl/deep.py), the trainer's start-up log and `rlmctl accept`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# NCCL/RCCL print the transport of every channel at INFO with the INIT subsystem, and the NICs
# with NET. The inventory's rlm_comm_env wins where it sets these itself.
DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
FABRICS = ("ib", "roce", "socket")
# rlm_* inventory variable -> NCCL environment variable (RoCE needs the GID index of the RoCE v2
# address and usually a traffic class that the switches map to the lossless queue).
FABRIC_ENV = {
    "rlm_nccl_ib_hca": "NCCL_IB_HCA",
    "rlm_nccl_ib_gid_index": "NCCL_IB_GID_INDEX",
    "rlm_nccl_ib_tc": "NCCL_IB_TC",
}

# "host:pid:tid [dev] NCCL INFO Channel 01/0 : 2[c7000] -> 0[87000] [receive] via NET/IB/5/GDRDMA"
_CHANNEL = re.compile(
    r"^(?P<host>[^:\s]*):\d+:\d+ \[\d+\] NCCL INFO Channel (?P<channel>\d+)(?:/\d+)? : "
    r"(?P<src>\d+)\[[^\]]*\] -> (?P<dst>\d+)\[[^\]]*\](?: \[(?P<dir>send|receive)\])? "
    r"via (?P<via>\S+)"
)
_NET_IB = re.compile(
    r"^(?P<host>[^:\s]*):\d+:\d+ \[\d+\] NCCL INFO NET/IB : Using (?P<nics>.*?)(?: ;|$)"
)
_NET_SOCKET = re.compile(
    r"^(?P<host>[^:\s]*):\d+:\d+ \[\d+\] NCCL INFO NET/Socket : Using (?P<ifs>.*)$"
)
_RANK = re.compile(
    r"^(?P<host>[^:\s]*):\d+:\d+ \[\d+\] NCCL INFO ncclCommInitRank .* rank (?P<rank>\d+) "
)
_NETWORK = re.compile(r"NCCL INFO Using network (\S+)")


@dataclass
class Channel:
    host: str  # the host that logged it
    channel: int
    src: int  # ranks
    dst: int
    via: str  # as logged: NET/IB/5/GDRDMA, NET/Socket/3, P2P/IPC/read, SHM/direct/direct, NVLS

    @property
    def kind(self) -> str:
        """net (between nodes) or the intra-node transport: p2p, shm, nvls, collnet."""
        return self.via.split("/", 1)[0].lower()

    @property
    def network(self) -> str | None:
        """IB, IBext_v8, Socket ... for NET channels."""
        parts = self.via.split("/")
        return parts[1] if self.kind == "net" and len(parts) > 1 else None

    @property
    def gdr(self) -> bool:
        return self.via.upper().endswith("/GDRDMA")


@dataclass
class CommPath:
    channels: list[Channel] = field(default_factory=list)
    ib_nics: dict[str, list[str]] = field(default_factory=dict)  # host -> ["mlx5_0:1/IB", ...]
    socket_ifs: dict[str, list[str]] = field(default_factory=dict)  # host -> ["ib0:192.168.11.1"]
    rank_hosts: dict[int, str] = field(default_factory=dict)
    networks: set[str] = field(default_factory=set)  # "Using network IB|IBext|Socket"

    def transports(self) -> dict[str, int]:
        """Channel count per transport, GPUDirect or not (NET/IB/GDRDMA, NET/Socket, P2P/IPC)."""
        counts: dict[str, int] = {}
        for c in self.channels:
            name = f"NET/{c.network}" + ("/GDRDMA" if c.gdr else "") if c.kind == "net" else c.via
            counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items()))

    def summary(self) -> str:
        """One line: the transports with channel counts and the NICs."""
        if not self.channels and not self.ib_nics and not self.socket_ifs:
            return "no NCCL transport lines (NCCL_DEBUG=INFO not set, or gloo)"
        parts = [f"{name} x{count}" for name, count in self.transports().items()]
        nics = sorted({n for nics in self.ib_nics.values() for n in nics})
        if nics:
            parts.append("IB NICs " + " ".join(nics))
        ifs = sorted({i for ifs in self.socket_ifs.values() for i in ifs})
        if ifs and not nics:
            parts.append("socket " + " ".join(ifs))
        return "; ".join(parts) or "no channels logged"

    def as_dict(self) -> dict[str, Any]:
        return {
            "transports": self.transports(),
            "ib_nics": self.ib_nics,
            "socket_ifs": self.socket_ifs,
            "summary": self.summary(),
        }


def _names(listing: str) -> list[str]:
    """'[0]mlx5_0:1/IB [1]mlx5_1:1/RoCE' -> ['mlx5_0:1/IB', 'mlx5_1:1/RoCE']."""
    return [re.sub(r"<\d+>$", "", word) for word in re.findall(r"\[\d+\](\S+)", listing)]


def parse(text: str) -> CommPath:
    """Every channel, NIC and rank -> host line of an NCCL/RCCL NCCL_DEBUG=INFO log (several
    ranks' and hosts' output interleaved is fine; other lines are ignored)."""
    path = CommPath()
    for line in text.splitlines():
        line = line.strip()
        match = _CHANNEL.match(line)
        if match:
            path.channels.append(
                Channel(
                    match["host"],
                    int(match["channel"]),
                    int(match["src"]),
                    int(match["dst"]),
                    match["via"],
                )
            )
            continue
        match = _NET_IB.match(line)
        if match:
            known = path.ib_nics.setdefault(match["host"], [])
            known.extend(n for n in _names(match["nics"]) if n not in known)
            continue
        match = _NET_SOCKET.match(line)
        if match:
            known = path.socket_ifs.setdefault(match["host"], [])
            known.extend(n for n in _names(match["ifs"]) if n not in known)
            continue
        match = _RANK.match(line)
        if match:
            path.rank_hosts[int(match["rank"])] = match["host"]
            continue
        match = _NETWORK.search(line)
        if match:
            path.networks.add(match.group(1))
    return path


def judge(path: CommPath, fabric: str | None, gpudirect: bool | None) -> list[str]:
    """What contradicts the inventory, one line each naming the host pair and the transport:
    a NET channel that is not over the expected fabric (ib/roce: NET/IB*, socket: NET/Socket),
    RoCE expected but the NICs say IB (or the reverse), GPUDirect expected but not used."""
    problems: list[str] = []
    if not fabric:
        return problems
    seen: set[tuple[str, str, str]] = set()
    for c in path.channels:
        if c.kind != "net":
            continue
        pair = (c.host or "?", path.rank_hosts.get(c.dst, f"rank {c.dst}"))
        if c.host and pair[1] == c.host:
            pair = (c.host, path.rank_hosts.get(c.src, f"rank {c.src}"))
        network = (c.network or "").lower()
        wrong = network != "socket" if fabric == "socket" else not network.startswith("ib")
        if wrong and (pair[0], pair[1], c.via) not in seen:
            seen.add((pair[0], pair[1], c.via))
            problems.append(
                f"{pair[0]} <-> {pair[1]}: channel {c.channel} via {c.via}, expected {fabric}"
            )
        elif gpudirect and not wrong and fabric != "socket" and not c.gdr:
            key = (pair[0], pair[1], "no-gdr")
            if key not in seen:
                seen.add(key)
                problems.append(
                    f"{pair[0]} <-> {pair[1]}: channel {c.channel} via {c.via} without GPUDirect "
                    "RDMA (/GDRDMA), expected rlm_gpudirect: true"
                )
    layer = {"ib": "/IB", "roce": "/RoCE"}.get(fabric)
    for host, nics in sorted(path.ib_nics.items()):
        off = [n for n in nics if layer and layer.lower() not in n.lower()]
        if off:
            problems.append(f"{host or '?'}: NICs {' '.join(off)} are not {fabric}")
    if (
        fabric != "socket"
        and not path.ib_nics
        and not any(
            c.kind == "net" and (c.network or "").lower().startswith("ib") for c in path.channels
        )
    ):
        where = sorted(path.socket_ifs) or ["?"]
        if path.socket_ifs or any(c.kind == "net" for c in path.channels):
            problems.append(
                f"{', '.join(h or '?' for h in where)}: NCCL found no {fabric} NIC and uses "
                "TCP sockets (NET/Socket): check NCCL_IB_DISABLE, the net plugin, NCCL_IB_HCA"
            )
    return problems


def fabric_env(settings: dict[str, Any]) -> dict[str, str]:
    """NCCL variables for the inventory's rlm_nccl_ib_* settings that are set."""
    return {
        env: str(settings[var])
        for var, env in FABRIC_ENV.items()
        if settings.get(var) not in (None, "")
    }

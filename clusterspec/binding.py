"""Which CPUs are near each GPU of a node, and which each rank gets (stdlib only).

From what the node itself reports, gathered by the slurm role on every compute node (and readable
again on the node at run time, `python -m clusterspec.binding plan`):

- `lscpu --parse=CPU,CORE,SOCKET,NODE`: every online CPU's core, socket and NUMA node;
- the vendor's topology command (its description's TOPOLOGY.COMMAND, read by TOPOLOGY.locality):
  `nvidia-smi topo -m` prints the CPUs near each GPU (CPU Affinity) and their NUMA node; `rocm-smi
  --showtopo` the NUMA node of each GPU (its "Numa Nodes" block, also `--showtoponuma`).
  nvidia-smi run inside a cpuset (a Slurm job) prints an empty CPU Affinity for a GPU whose CPUs
  are all outside it: the NUMA node then says which CPUs are near it.

What it makes of them:

- gres.conf `Cores=` per GPU: the cores near it as Slurm numbers cores, which is not the Linux
  CPU id: "Core 0 will be the first core on the first socket, while core 1 will be the second
  core on the first socket" (gres.conf(5), 22.05). Slurm matches GPUs to cores per socket or NUMA
  node, so a GPU gets every core of its NUMA node, not a share.
- a rank plan: local rank r drives GPU r and gets its own share of the cores near that GPU (the
  cores of a NUMA node split evenly among its GPUs, each core with all its hardware threads).
  Rendered three ways: `--cpus-per-task` (the smallest share; Slurm takes one number),
  `--cpu-bind=mask_cpu:` for an srun step of one task per GPU (masks of Linux CPU ids, as
  task/affinity applies them), and CPU lists for the workers torchrun starts, which pin
  themselves (`python -m clusterspec.binding pin -- COMMAND`, RANK_CPUS_ENV).

Nodes without GPUs (rlm_gpu_vendor none: CPU workers) split all their CPUs among the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clusterspec.vendors import VENDORS
from clusterspec.vendors.readings import ToolError, by_sku

LSCPU = ("lscpu", "--parse=CPU,CORE,SOCKET,NODE")
# Per local rank, its CPUs: "0-13,112-125;14-27,126-139;..." (`pin` reads it with LOCAL_RANK).
RANK_CPUS_ENV = "RLM_RANK_CPUS"


class BindingError(ValueError):
    """Facts that do not add up to a binding (one line, naming what is wrong)."""


@dataclass(frozen=True)
class Cpu:
    cpu: int  # the Linux CPU id (what taskset, sched_setaffinity and mask_cpu use)
    core: int
    socket: int
    node: int  # NUMA node


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise BindingError(f"{text!r} is not a CPU list like 0-3,8")
        out.extend(range(int(first), int(last or first) + 1))
    return sorted(set(out))


def format_cpulist(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8' (the kernel's and Slurm's notation)."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def parse_lscpu(text: str) -> list[Cpu]:
    """`lscpu --parse=CPU,CORE,SOCKET,NODE` (or `lscpu -p`, or the table of `lscpu -e`): every
    online CPU. Columns are found by the header; a machine without NUMA prints no node (node 0)."""
    lines = [line for line in text.splitlines() if line.strip()]
    parsable = [line for line in lines if not line.startswith("#")]
    header = next((line for line in reversed(lines) if line.startswith("# CPU")), None)
    if header is not None:
        names = [name.strip().lower() for name in header[1:].split(",")]
        rows = [line.split(",") for line in parsable]
    elif lines and lines[0].split()[:1] == ["CPU"]:  # lscpu -e
        names = [name.lower() for name in lines[0].split()]
        rows = [line.split() for line in lines[1:]]
    else:
        raise BindingError("lscpu printed no CPU table (no '# CPU,Core,...' header)")
    missing = {"cpu", "core", "socket"} - set(names)
    if missing:
        raise BindingError(f"lscpu printed no {', '.join(sorted(missing))} column")
    out = []
    for row in rows:
        cell = dict(zip(names, row, strict=False))  # lscpu -p may end rows early
        if cell.get("online", "yes").lower() in ("no", "n"):
            continue
        try:
            out.append(
                Cpu(
                    int(cell["cpu"]),
                    int(cell["core"]),
                    int(cell["socket"]),
                    int(cell.get("node") or 0),
                )
            )
        except (KeyError, ValueError):
            raise BindingError(f"lscpu row {','.join(row)!r} is not CPU,CORE,SOCKET,NODE") from None
    if not out:
        raise BindingError("lscpu listed no online CPU")
    return sorted(out, key=lambda c: c.cpu)


@dataclass(frozen=True)
class NodeCpus:
    """A node's CPUs, and Slurm's numbering of its cores."""

    cpus: tuple[Cpu, ...]

    @classmethod
    def from_lscpu(cls, text: str) -> NodeCpus:
        return cls(tuple(parse_lscpu(text)))

    @property
    def ids(self) -> list[int]:
        return [c.cpu for c in self.cpus]

    def _cores(self) -> list[tuple[int, int]]:
        """(socket, core) of every core in Slurm's order: socket by socket, and within a socket
        by the core's first CPU (the order of lstopo's logical core numbers, "Core L#")."""
        first: dict[tuple[int, int], int] = {}
        for c in self.cpus:
            key = (c.socket, c.core)
            first[key] = min(first.get(key, c.cpu), c.cpu)
        return sorted(first, key=lambda key: (key[0], first[key]))

    @property
    def sockets(self) -> int:
        return len({c.socket for c in self.cpus})

    @property
    def cores_per_socket(self) -> int:
        return len(self._cores()) // self.sockets

    @property
    def threads_per_core(self) -> int:
        return len(self.cpus) // len(self._cores())

    def core_index(self) -> dict[int, int]:
        """Linux CPU id -> Slurm's core index (gres.conf Cores=)."""
        index = {key: i for i, key in enumerate(self._cores())}
        return {c.cpu: index[(c.socket, c.core)] for c in self.cpus}

    def numa_cpus(self, node: int) -> list[int]:
        return [c.cpu for c in self.cpus if c.node == node]

    def slurm_cores(self, cpus: Iterable[int]) -> str:
        """The Slurm core indices ('0-27') of the cores holding any of `cpus`."""
        index = self.core_index()
        return format_cpulist(index[cpu] for cpu in cpus if cpu in index)

    def cores_of(self, cpus: Iterable[int]) -> list[list[int]]:
        """The cores holding any of `cpus`, in Slurm's order, each as its CPUs among `cpus`."""
        wanted = set(cpus)
        by_core: dict[tuple[int, int], list[int]] = {}
        for c in self.cpus:
            if c.cpu in wanted:
                by_core.setdefault((c.socket, c.core), []).append(c.cpu)
        return [sorted(by_core[key]) for key in self._cores() if key in by_core]


def gpu_cpus(node: NodeCpus, vendor: str, topology_text: str, gpus: int) -> dict[int, list[int]]:
    """GPU index -> the CPUs near it, for the first `gpus` GPUs the vendor tool lists. Without a
    GPU vendor, `gpus` CPU workers near every CPU."""
    everything = node.ids
    if vendor not in VENDORS:
        return {gpu: everything for gpu in range(gpus)}
    try:
        topo = VENDORS[vendor].TOPOLOGY.locality(topology_text)
    except ToolError as error:
        raise BindingError(str(error)) from None
    listed, affinity, numa = topo.gpus, topo.cpu_affinity, topo.numa
    command = " ".join(VENDORS[vendor].TOPOLOGY.COMMAND)
    if len(listed) < gpus:
        raise BindingError(f"{command} lists {len(listed)} GPUs, the node should have {gpus}")
    known, out = set(everything), {}
    for gpu in range(gpus):
        key = str(gpu)
        # The NUMA node first: the CPU Affinity is cut to the cpuset nvidia-smi ran in.
        near = node.numa_cpus(int(numa[key])) if key in numa else []
        if not near and key in affinity:
            near = [cpu for cpu in parse_cpulist(affinity[key]) if cpu in known]
        out[gpu] = near or everything  # no NUMA information: every CPU is as near as any
    return out


def gres_lines(node: NodeCpus, near: dict[int, list[int]]) -> list[dict[str, Any]]:
    """gres.conf lines of a node: runs of consecutive GPUs near the same cores, each with its
    first and last GPU index and Slurm's core indices ('0-27')."""
    out: list[dict[str, Any]] = []
    for gpu in sorted(near):
        cores = node.slurm_cores(near[gpu])
        if out and out[-1]["cores"] == cores and out[-1]["last"] == gpu - 1:
            out[-1]["last"] = gpu
        else:
            out.append({"first": gpu, "last": gpu, "cores": cores})
    return out


def gpu_type(vendor: str, names: list[str]) -> str:
    """gres.conf Type= of a node's GPUs: the bundle's SKU name for the model (h100, h100_pcie,
    mi250x), else the model name without the vendor's words ("NVIDIA L40S" -> l40s). A node with
    mixed models is refused: Slurm would schedule one type onto another's device files."""
    models = sorted({name.strip() for name in names if name.strip()})
    if len(models) > 1:
        raise BindingError(f"the node has GPUs of several models ({'; '.join(models)})")
    if not models:
        raise BindingError("the GPU query printed no model name")
    description = VENDORS.get(vendor)
    _, sku = by_sku(description.PEAK_BF16_FLOPS, models[0]) if description else (None, None)
    brand = description.BRAND_WORDS if description else frozenset()
    words = [w for w in re.split(r"[\s/]+", sku or models[0]) if w.upper() not in brand]
    return re.sub(r"[^a-z0-9]+", "_", " ".join(words).lower()).strip("_")


def gpu_names(vendor: str, text: str) -> list[str]:
    """Model names printed by the vendor's NAME_QUERY."""
    try:
        return VENDORS[vendor].parse_names(text)
    except ToolError as error:
        raise BindingError(str(error)) from None


@dataclass(frozen=True)
class RankPlan:
    ranks: tuple[tuple[int, ...], ...]  # per local rank, its Linux CPU ids

    @property
    def cpus_per_task(self) -> int:
        return min(len(cpus) for cpus in self.ranks)

    @property
    def cpu_lists(self) -> list[str]:
        return [format_cpulist(cpus) for cpus in self.ranks]

    @property
    def cpu_bind(self) -> str:
        """srun --cpu-bind for one task per GPU: task t gets rank t's CPUs."""
        return "mask_cpu:" + ",".join(hex(sum(1 << cpu for cpu in cpus)) for cpus in self.ranks)

    def as_dict(self) -> dict[str, Any]:
        return {
            "cpus_per_task": self.cpus_per_task,
            "cpu_bind": self.cpu_bind,
            "ranks": self.cpu_lists,
            RANK_CPUS_ENV: ";".join(self.cpu_lists),
        }


def rank_plan(node: NodeCpus, near: dict[int, list[int]]) -> RankPlan:
    """Rank r (GPU r) gets an equal share of the cores near GPU r, none shared with another
    rank: the GPUs near the same CPUs split those cores in GPU order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for gpu in sorted(near):
        groups.setdefault(tuple(near[gpu]), []).append(gpu)
    taken: set[int] = set()
    ranks: dict[int, list[int]] = {}
    for cpus, members in groups.items():
        cores = [core for core in node.cores_of(cpus) if not taken & set(core)]
        share = len(cores) // len(members)
        if share == 0:
            raise BindingError(
                f"GPUs {format_cpulist(members)} share {len(cores)} free cores "
                f"({format_cpulist(cpus)}): fewer than one per GPU"
            )
        for i, gpu in enumerate(members):
            ranks[gpu] = sorted(cpu for core in cores[i * share : (i + 1) * share] for cpu in core)
            taken.update(ranks[gpu])
    return RankPlan(tuple(tuple(ranks[gpu]) for gpu in sorted(ranks)))


def node_binding(
    lscpu_text: str,
    vendor: str,
    gpus: int,
    topology_text: str | None = "",
    names_text: str | None = "",
    gpu_type_setting: str = "",
) -> dict[str, Any]:
    """What the slurm role renders for one node: its CPU layout for the node line, and per run of
    GPUs the cores near them (gres.conf) with the GPUs' type, and the rank plan. topology_text
    None: the GPUs' topology could not be read (a driver not loaded until the next boot), so no
    cores are named; names_text None: no type unless gpu_type_setting gives it."""
    node = NodeCpus.from_lscpu(lscpu_text)
    has_gpus = vendor in VENDORS and gpus > 0
    if has_gpus and topology_text is None:
        near = {gpu: node.ids for gpu in range(gpus)}
        lines = [{"first": 0, "last": gpus - 1, "cores": ""}]
    else:
        near = gpu_cpus(node, vendor, topology_text or "", gpus)
        lines = gres_lines(node, near) if has_gpus else []
    kind = gpu_type_setting
    if has_gpus and not kind and names_text is not None:
        kind = gpu_type(vendor, gpu_names(vendor, names_text))
    plan = rank_plan(node, near) if gpus > 0 else None
    return {
        "cpus": len(node.cpus),
        "sockets": node.sockets,
        "cores_per_socket": node.cores_per_socket,
        "threads_per_core": node.threads_per_core,
        "gpu_type": kind,
        "gres": lines,
        "plan": plan.as_dict() if plan else {},
    }


def _run(argv: Sequence[str]) -> str:
    if shutil.which(argv[0]) is None:
        raise BindingError(f"{argv[0]} is not installed")
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        why = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise BindingError(f"{' '.join(argv)} failed: {why}")
    return result.stdout


def plan_here(gpus: int, vendor: str = "auto") -> dict[str, Any]:
    """node_binding of this host, from its own lscpu and vendor tools."""
    from clusterspec.vendors import detect_vendor

    vendor = detect_vendor() if vendor == "auto" else vendor
    topology = names = ""
    if vendor in VENDORS and gpus > 0:
        topology = _run(VENDORS[vendor].TOPOLOGY.COMMAND)
        names = _run(VENDORS[vendor].NAME_QUERY)
    return node_binding(_run(LSCPU), vendor, gpus, topology, names)


def pin(argv: list[str], environ: Mapping[str, str] = os.environ) -> None:
    """Pin this process to its local rank's CPUs (RANK_CPUS_ENV, LOCAL_RANK), then exec argv: a
    torchrun worker keeps its pid and runs only on the cores near its GPU."""
    lists = [part for part in environ.get(RANK_CPUS_ENV, "").split(";") if part]
    rank = int(environ.get("LOCAL_RANK", "0"))
    if lists:
        if rank >= len(lists):
            raise BindingError(f"{RANK_CPUS_ENV} has {len(lists)} CPU lists, no LOCAL_RANK {rank}")
        try:
            os.sched_setaffinity(0, parse_cpulist(lists[rank]))
        except OSError as error:  # none of them in this process's cpuset: train unpinned
            print(f"rank {rank} not pinned to CPUs {lists[rank]}: {error}", file=sys.stderr)
    os.execvp(argv[0], argv)


def _read(path: str | None) -> str:
    if not path:
        return ""
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clusterspec.binding", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="this node's gres.conf lines and rank plan, as JSON")
    plan.add_argument("--gpus", type=int, required=True, help="ranks (GPUs) per node")
    plan.add_argument("--vendor", default="auto", choices=["auto", "none", *VENDORS])
    plan.add_argument("--lscpu", help="a file of lscpu --parse output instead of this node's")
    plan.add_argument("--topology", help="a file of the vendor's topology output")
    plan.add_argument("--names", help="a file of the vendor's GPU name query output")
    run = sub.add_parser("pin", help="pin to LOCAL_RANK's CPUs in $" + RANK_CPUS_ENV + ", exec")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    opts = parser.parse_args(args)
    try:
        if opts.command == "pin":
            argv = opts.argv[1:] if opts.argv[:1] == ["--"] else opts.argv
            if not argv:
                raise BindingError("pin needs a command: pin -- COMMAND [ARGS]")
            pin(argv)
        if opts.lscpu:
            texts = [_read(path) for path in (opts.lscpu, opts.topology, opts.names)]
            vendor = "none" if opts.vendor == "auto" else opts.vendor
            result = node_binding(texts[0], vendor, opts.gpus, *texts[1:])
        else:
            result = plan_here(opts.gpus, opts.vendor)
    except (BindingError, OSError) as error:
        print(f"clusterspec.binding: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`rlmctl health --deep`: a real collective across the selected hosts, plus nccl/rccl-tests.

1. torchrun on every host (same rendezvous as a training launch) runs `trainer.allreduce`: a timed
   all-reduce that proves every host can join the job and reports bus bandwidth.
2. Where `all_reduce_perf` (nccl-tests / rccl-tests) is installed, each host runs it on its own
   GPUs at one large size (16 GiB, the size the floors are published for) and its bus bandwidth
   is judged against the inventory's `rlm_comm_busbw_floor_gbps` (0: report only) or, when that
   is not set, the published floor of its GPU model (clusterspec.vendors BUSBW_FLOORS_GBPS).
3. Both run with NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET: the transport of every channel and
   the NICs NCCL chose are read from the log (clusterspec.transport) and judged against the
   inventory's rlm_fabric / rlm_gpudirect; a mismatch (e.g. a silent fall-back to NET/Socket)
   fails the gate with the host pair and the transport seen.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
from dataclasses import dataclass, field
from typing import Any

from clusterspec import transport, vendors
from clusterspec.inventory import Host
from rlmctl.remote import Fleet, with_env

PROBE_TIMEOUT_S = 300


@dataclass
class DeepResult:
    ok: bool
    allreduce: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)
    per_host_busbw: dict[str, float] = field(default_factory=dict)
    comm_path: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> CommPath.as_dict

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "allreduce": self.allreduce,
            "problems": self.problems,
            "all_reduce_perf_busbw_gbps": self.per_host_busbw,
            "comm_path": self.comm_path,
        }

    def summary(self) -> str:
        lines = []
        if self.allreduce:
            a = self.allreduce
            lines.append(
                f"deep: all-reduce over {a['world']} ranks ({a['backend']}): "
                f"{a['busbw_gbps']:.2f} GB/s busbw, {'correct' if a['correct'] else 'WRONG RESULT'}"
            )
        lines += [f"deep: {host}: transport {p['summary']}" for host, p in self.comm_path.items()]
        lines += [
            f"deep: {host}: all_reduce_perf {bw:.1f} GB/s"
            for host, bw in self.per_host_busbw.items()
        ]
        lines += [f"deep CRIT: {p}" for p in self.problems]
        return "\n".join(lines) or "deep: nothing to check"


def parse_all_reduce_perf(text: str) -> dict[str, Any]:
    """Rows and footer of nccl-tests/rccl-tests `all_reduce_perf` output.

    A row: size count type redop root, then out-of-place (time algbw busbw #wrong) and in-place
    (time algbw busbw #wrong). Returns {"rows": [...], "avg_busbw": float|None, "ok": bool}.
    """
    rows = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 13 or line.lstrip().startswith("#") or not fields[0].isdigit():
            continue
        rows.append(
            {
                "size": int(fields[0]),
                "type": fields[2],
                "busbw_out": float(fields[7]),
                "wrong_out": fields[8],
                "busbw_in": float(fields[11]),
                "wrong_in": fields[12],
            }
        )
    avg = re.search(r"#\s*Avg bus bandwidth\s*:\s*([\d.]+)", text)
    bounds = re.search(r"#\s*Out of bounds values\s*:\s*(\d+)\s+(OK|FAILED)", text)
    wrong = any(
        r["wrong_out"] not in ("0", "N/A") or r["wrong_in"] not in ("0", "N/A") for r in rows
    )
    return {
        "rows": rows,
        "avg_busbw": float(avg.group(1)) if avg else None,
        "ok": bool(rows) and not wrong and (bounds is None or bounds.group(2) == "OK"),
    }


def judge_busbw(parsed: dict[str, Any], gpu_name: str, floor: float | None) -> str | None:
    """None when the largest size reaches the floor, else the problem in one line."""
    if not parsed["ok"]:
        return "all_reduce_perf reported wrong results or out-of-bounds values"
    if floor is None:
        floor = vendors.busbw_floor_gbps(gpu_name)
    if floor is None:
        return None
    largest = max(parsed["rows"], key=lambda r: r["size"])
    busbw = min(largest["busbw_out"], largest["busbw_in"])
    if busbw < 0.9 * floor:  # nccl-tests' own NCCL_TESTS_MIN_BW margin
        return f"busbw {busbw:.1f} GB/s at {largest['size']} B is below 90% of the {floor:g} GB/s floor"
    return None


def _probe_command(host: Host, hosts: list[Host], rdzv_id: str) -> str:
    first = hosts[0]
    argv = [
        host.python, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}",
        f"--nproc-per-node={host.gpus_per_node}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={first.address}:{first.rdzv_port}", f"--rdzv-id={rdzv_id}",
        "--max-restarts=0", "-m", "trainer.allreduce",
    ]  # fmt: skip
    return with_env(shlex.join(argv) + " 2>&1", debug_env(host))


def debug_env(host: Host) -> dict[str, str]:
    """The host's comm environment with NCCL's transport logging on (its own settings win)."""
    return {**transport.DEBUG_ENV, **host.comm_env}


def judge_comm_path(host: Host, log: str, result: DeepResult) -> None:
    """Record the transport `host`'s ranks logged; a mismatch with rlm_fabric is a problem."""
    path = transport.parse(log)
    if not path.channels and not path.ib_nics and not path.socket_ifs:
        return  # gloo (CPU hosts) or a tool that printed no NCCL lines
    result.comm_path[host.name] = path.as_dict()
    result.problems += [
        f"{host.name}: {p}" for p in transport.judge(path, host.fabric, host.gpudirect)
    ]


def run(fleet: Fleet, hosts: list[Host]) -> DeepResult:
    result = DeepResult(ok=True, allreduce=None)
    if not hosts:
        return DeepResult(False, None, ["no healthy host to run the deep checks on"])
    rdzv_id = f"deep-{secrets.token_hex(4)}"
    outcomes = fleet.run(
        lambda h: _probe_command(h, hosts, rdzv_id), hosts=hosts, timeout=PROBE_TIMEOUT_S
    )
    for outcome in outcomes:
        if not outcome.ok:
            result.problems.append(f"{outcome.host}: all-reduce probe failed: {outcome.reason}")
        for line in outcome.stdout.splitlines():
            if line.startswith("RLMCTL-ALLREDUCE "):
                result.allreduce = json.loads(line.split(" ", 1)[1])
        host = next(h for h in hosts if h.name == outcome.host)
        judge_comm_path(host, outcome.stdout, result)
    if result.allreduce and not result.allreduce["correct"]:
        result.problems.append("all-reduce returned a wrong sum: a rank computes garbage")
    gpu_hosts = [h for h in hosts if h.gpu_vendor != "none"]  # auto: the command detects it
    if gpu_hosts:
        _all_reduce_perf(fleet, gpu_hosts, result)
    result.ok = not result.problems and result.allreduce is not None
    return result


def _all_reduce_perf(fleet: Fleet, hosts: list[Host], result: DeepResult) -> None:
    def command(host: Host) -> str:
        name = (
            "{ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || "
            "rocm-smi --showproductname 2>/dev/null | grep -o 'MI[0-9A-Z]*'; } | head -n 1"
        )
        perf = with_env(f"all_reduce_perf -b 16G -e 16G -g {host.gpus_per_node}", debug_env(host))
        return f'command -v all_reduce_perf >/dev/null || exit 99; echo "GPU: $({name})"; {perf}'

    for host, outcome in zip(
        hosts, fleet.run(command, hosts=hosts, timeout=PROBE_TIMEOUT_S), strict=True
    ):
        if outcome.rc == 99:
            continue  # not installed: the torch all-reduce above is the check
        if not outcome.ok:
            result.problems.append(f"{host.name}: all_reduce_perf failed: {outcome.reason}")
            continue
        gpu = re.search(r"^GPU: (.*)$", outcome.stdout, re.M)
        parsed = parse_all_reduce_perf(outcome.stdout)
        if parsed["rows"]:
            largest = max(parsed["rows"], key=lambda r: r["size"])
            result.per_host_busbw[host.name] = min(largest["busbw_out"], largest["busbw_in"])
        if host.busbw_floor_gbps == 0:
            continue  # rlm_comm_busbw_floor_gbps: 0 reports without gating
        problem = judge_busbw(parsed, gpu.group(1) if gpu else "", host.busbw_floor_gbps)
        if problem:
            result.problems.append(f"{host.name}: {problem}")

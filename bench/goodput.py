"""Goodput under faults on the rig: a fixed checkpoint interval against `--checkpoint-interval auto`.

`--backend ssh` (default): a rig of 4 hosts (network namespaces, real sshd, real SSH from the
CLI, torchrun/gloo, one CPU worker per host) trains the `tiny` model for N steps, launched by
`rlmctl launch` and supervised by `rlmctl watch --exclude-stragglers`. Node failures come at
random: exponential times between kills with rate hosts / per-node MTBF, each SIGKILLing every
process of the run on one host of the current attempt (launcher, torchrun, worker), the same
schedule (seeded, from the launch) for both runs. One host is slow (its worker sleeps per
micro-batch: a straggler), so the first restart also leaves it out.

`--backend slurm`: the Slurm cluster of tests/slurm with a fourth compute node (1 mgmt + 4
compute systemd nodes, real slurmctld/slurmd/munge/slurmdbd, set up by site.yml first: ~7 min)
runs 2-node jobs of the same model; a kill SIGKILLs the trainer (torchrun and its worker) on a
node of the running job, whose wrapper lives on to write the exit record; node3 is the slow one.
With the straggler out, 3 nodes are left for 2-node jobs: the run lasts only because watch lets a
node that failed once back in once Slurm has it in service (`--strikes`, default 2).

Run (a) keeps the configured interval; run (b) lets watch set it from the measured failure rate
and checkpoint stall (Young/Daly) on every restart. Prints, per run, the goodput and each part of
the wall time (runcontract.goodput), and the ratio b/a.

Prints figures; asserts nothing. Needs root (the rig); uses RLM_RIG_ID (default 0), slot 8 (SSH)
or 9 (Slurm).

    RLM_RIG_ID=9 .venv/bin/python bench/goodput.py [--backend slurm] [--steps 300]
        [--node-mtbf 300] [--interval 100]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/goodput.py` puts only bench/ on the path

from runcontract.goodput import PARTS, Goodput, goodput  # noqa: E402
from runcontract.interval import expected_goodput  # noqa: E402
from runcontract.rundir import RunDir  # noqa: E402
from tests import goodput_faults  # noqa: E402
from tests.rig import Rig  # noqa: E402
from tests.slurm import slurm_rig  # noqa: E402

HOSTS = 4
SLOW_HOST = "node3"
# Slurm: node1 mgmt and 4 compute nodes for 2-node jobs: with the straggler left out, one spare
# for a failed node to sit out an attempt on.
SLURM_RIG_NODES, SLURM_NODES = 5, 2
TINY = REPO / "trainer" / "configs" / "tiny.yaml"


def rlmctl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlmctl", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def current_hosts(run: RunDir) -> list[str]:
    launched = [e for e in run.events() if e.kind == "launched"]
    return list(launched[-1].fields.get("hosts") or []) if launched else []


def kill_ssh_host(rig: Rig, run: RunDir, rng: random.Random) -> tuple[str, int]:
    """Every process of the run on one host of the current attempt, as a node that dies."""
    hosts = current_hosts(run)
    host = rng.choice(hosts) if hosts else None
    return (host, len(goodput_faults.kill_host(rig, host, run.path))) if host else ("-", 0)


def kill_slurm_node(rig: Rig, run: RunDir, rng: random.Random) -> tuple[str, int]:
    """The trainer (torchrun and its worker) on one node of the running job."""
    find = "pgrep -f '[t]rainer train' || true"
    nodes = [h.name for h in rig.hosts[1:] if rig.exec(h.name, find).stdout.split()]
    if not nodes:
        return "-", 0
    node = rng.choice(nodes)
    killed = rig.exec(node, "pgrep -f '[t]rainer train'; pkill -KILL -f '[t]rainer train'")
    return node, len(killed.stdout.split())


Kill = Callable[[Rig, RunDir, random.Random], tuple[str, int]]  # what it hit: host, processes


class Killer(threading.Thread):
    """Kills at exponential intervals (seeded) with `kill` until stopped."""

    def __init__(self, rig: Rig, run: RunDir, rate_per_s: float, seed: int, kill: Kill) -> None:
        super().__init__(daemon=True)
        self.rig, self.rundir, self.rate, self.kill = rig, run, rate_per_s, kill
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.kills: list[tuple[float, str, int]] = []  # (seconds after launch, host, processes)
        self.started = time.monotonic()

    def run(self) -> None:
        due = self.rng.expovariate(self.rate)
        while not self.stop.wait(max(0.0, due - (time.monotonic() - self.started))):
            host, killed = self.kill(self.rig, self.rundir, self.rng)
            self.kills.append((round(time.monotonic() - self.started, 1), host, killed))
            due += self.rng.expovariate(self.rate)


def one_run(
    rig: Rig, inventory: Path, name: str, mode: str, args: argparse.Namespace
) -> tuple[Goodput, Killer, str]:
    slurm = args.backend == "slurm"
    nodes = SLURM_NODES if slurm else HOSTS
    overrides = [
        "data.path=data",
        f"train.steps={args.steps}",
        "train.global_batch=12",
        "train.micro_batch=1",
        "model.mean_recurrence=2",
        "train.precision=fp32",
        "eval.every=0",
        "metrics.log_every=5",
        f"checkpoint.interval_steps={args.interval}",
    ]
    inv = ["-i", str(inventory)]
    size = ["--nodes", str(SLURM_NODES)] if slurm else []
    launched = rlmctl(*inv, "launch", "--config", str(TINY), "--name", name, *size, *overrides)
    if launched.returncode != 0:
        raise SystemExit(f"launch of {name} failed: {launched.stderr.strip()}")
    run = RunDir(rig.shared_dir / "runs" / name)
    kill = kill_slurm_node if slurm else kill_ssh_host
    killer = Killer(rig, run, nodes / args.node_mtbf, args.seed, kill)
    killer.start()
    try:
        said = rlmctl(
            *inv, "watch", name, "--poll", "1", "--backoff", "2", "--stall", "120",
            "--restarts", "40", "--exclude-stragglers", "--checkpoint-interval", mode,
            timeout=args.timeout,
        ).stderr  # fmt: skip
    except subprocess.TimeoutExpired:
        said = f"(the run did not end within {args.timeout:g} s: stopped, figures so far)"
        rlmctl(*inv, "stop", name, "--timeout", "30")
    killer.stop.set()
    killer.join()
    return goodput(run), killer, said


def report(label: str, g: Goodput, killer: Killer) -> None:
    print(f"\n({label}) goodput {100 * (g.ratio or 0):.1f} % of {g.wall_s:.0f} s wall")
    for part in PARTS:
        print(f"    {part:<17} {g.parts[part]:8.1f} s  {100 * g.parts[part] / g.wall_s:5.1f} %")
    hits = sum(1 for _, _, n in killer.kills if n)
    print(
        f"    kills {len(killer.kills)} ({hits} hit a running attempt), attempts {g.attempts}, "
        f"failures {g.failures}, steps lost {g.steps_lost}, restart cost "
        f"{g.restart_cost_s or 0:.1f} s, step {g.step_time_s or 0:.3f} s, stall per save "
        f"{g.checkpoint_stall_s or 0:.3f} s over {g.checkpoints} saves"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("ssh", "slurm"), default="ssh")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--node-mtbf", type=float, default=300.0, help="seconds per node")
    parser.add_argument("--interval", type=int, default=100, help="the fixed interval, steps")
    parser.add_argument("--slow-s", type=float, default=0.1, help="the straggler's sleep")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/goodput.py: skipped, the rig needs root")  # `make bench` goes on
        return
    slurm = args.backend == "slurm"
    nodes = SLURM_NODES if slurm else HOSTS
    work = Path(os.environ.get("RLM_BENCH_WORK", "/tmp/rlm-bench-goodput"))
    work.mkdir(parents=True, exist_ok=True)
    rig_nodes, slot = (SLURM_RIG_NODES, 9) if slurm else (HOSTS, 8)
    with Rig(rig_nodes, slot=slot, release="bookworm" if slurm else None) as rig:
        goodput_faults.install(rig.shared_dir, REPO)
        if slurm:
            slow = goodput_faults.env(slow_here_s=args.slow_s, slow_host=SLOW_HOST)
            inventory = slurm_rig.provision(rig, work, comm_env=slow)
        else:
            goodput_faults.prepare_data(rig.shared_dir, REPO)
            slow = goodput_faults.env(slow_here_s=args.slow_s)
            inventory = goodput_faults.rig_inventory(
                rig.inventory_path, rig.state_dir / "goodput-inventory.yml", {SLOW_HOST: slow}
            )
        print(
            f"{args.backend}: {nodes}-node jobs on a rig of {rig_nodes} nodes; load "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.steps} steps, per-node "
            f"MTBF {args.node_mtbf:g} s (job: {args.node_mtbf / nodes:g} s), fixed interval "
            f"{args.interval}, {SLOW_HOST} slow"
        )
        results = {}
        for label, mode in (("a", "keep"), ("b", "auto")):
            stamp = int(time.time())
            g, killer, said = one_run(rig, inventory, f"goodput-{label}-{stamp}", mode, args)
            results[label] = g
            report(f"{label}: {'fixed' if mode == 'keep' else 'auto'} interval", g, killer)
            for line in said.splitlines():
                words = ("checkpoint interval:", "straggler", "readmitting", "did not end", "gave")
                if any(w in line for w in words):
                    print(f"    watch: {line.strip()}")
            print("    json: " + json.dumps(g.to_dict(), sort_keys=True))
        a, b = results["a"], results["b"]
        if a.ratio and b.ratio:
            print(f"\ngoodput auto / fixed = {b.ratio / a.ratio:.3f}")
        if a.step_time_s and a.checkpoint_stall_s:
            mtbf = args.node_mtbf / nodes
            restart = a.restart_cost_s or 0.0
            for steps in (args.interval, 10):
                model = expected_goodput(steps * a.step_time_s, a.checkpoint_stall_s, mtbf, restart)
                print(f"model (first order), every {steps} steps: {100 * model:.1f} %")


if __name__ == "__main__":
    main()

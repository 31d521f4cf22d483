"""Goodput under faults on the rig: a fixed checkpoint interval against `--checkpoint-interval auto`.

A rig of 4 hosts (network namespaces, real sshd, real SSH from the CLI, torchrun/gloo, one CPU
worker per host) trains the `tiny` model for N steps, launched by `rlmctl launch` and supervised
by `rlmctl watch --exclude-stragglers`. Node failures come at random: exponential times between
kills with rate hosts / per-node MTBF, each SIGKILLing every process of the run on one host of
the current attempt (launcher, torchrun, worker), the same schedule (seeded, from the launch) for
both runs. One host is slow (its worker sleeps per micro-batch: a straggler), so the first restart
also leaves it out. Run (a) keeps the configured interval; run (b) lets watch set it from the
measured failure rate and checkpoint stall (Young/Daly) on every restart. Prints, per run, the
goodput and each part of the wall time (runcontract.goodput), and the ratio b/a.

Prints figures; asserts nothing. Needs root (the rig); uses RLM_RIG_ID (default 0), slot 8.

    RLM_RIG_ID=9 .venv/bin/python bench/goodput.py [--steps 300] [--node-mtbf 300] [--interval 100]
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/goodput.py` puts only bench/ on the path

from runcontract.goodput import PARTS, Goodput, goodput  # noqa: E402
from runcontract.interval import expected_goodput  # noqa: E402
from runcontract.rundir import RunDir  # noqa: E402
from tests import goodput_faults  # noqa: E402
from tests.rig import Rig  # noqa: E402

HOSTS = 4
SLOW_HOST = "node3"
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


class Killer(threading.Thread):
    """Kills one host's processes of the run at exponential intervals (seeded) until stopped."""

    def __init__(self, rig: Rig, run: RunDir, rate_per_s: float, seed: int) -> None:
        super().__init__(daemon=True)
        self.rig, self.rundir, self.rate = rig, run, rate_per_s
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.kills: list[tuple[float, str, int]] = []  # (seconds after launch, host, processes)
        self.started = time.monotonic()

    def run(self) -> None:
        due = self.rng.expovariate(self.rate)
        while not self.stop.wait(max(0.0, due - (time.monotonic() - self.started))):
            hosts = current_hosts(self.rundir)
            host = self.rng.choice(hosts) if hosts else None
            killed = goodput_faults.kill_host(self.rig, host, self.rundir.path) if host else []
            self.kills.append((round(time.monotonic() - self.started, 1), host or "-", len(killed)))
            due += self.rng.expovariate(self.rate)


def one_run(
    rig: Rig, inventory: Path, name: str, mode: str, args: argparse.Namespace
) -> tuple[Goodput, Killer, str]:
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
    launched = rlmctl(*inv, "launch", "--config", str(TINY), "--name", name, *overrides)
    if launched.returncode != 0:
        raise SystemExit(f"launch of {name} failed: {launched.stderr.strip()}")
    run = RunDir(rig.shared_dir / "runs" / name)
    killer = Killer(rig, run, HOSTS / args.node_mtbf, args.seed)
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
    with Rig(HOSTS, slot=8) as rig:
        print(
            f"rig of {HOSTS} hosts up; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
            f"{args.steps} steps, per-node MTBF {args.node_mtbf:g} s (job: "
            f"{args.node_mtbf / HOSTS:g} s), fixed interval {args.interval}, {SLOW_HOST} slow"
        )
        goodput_faults.prepare_data(rig.shared_dir, REPO)
        goodput_faults.install(rig.shared_dir, REPO)
        slow = goodput_faults.env(slow_here_s=args.slow_s)
        inventory = goodput_faults.rig_inventory(
            rig.inventory_path, rig.state_dir / "goodput-inventory.yml", {SLOW_HOST: slow}
        )
        results = {}
        for label, mode in (("a", "keep"), ("b", "auto")):
            stamp = int(time.time())
            g, killer, said = one_run(rig, inventory, f"goodput-{label}-{stamp}", mode, args)
            results[label] = g
            report(f"{label}: {'fixed' if mode == 'keep' else 'auto'} interval", g, killer)
            for line in said.splitlines():
                if any(w in line for w in ("checkpoint interval:", "straggler", "did not end")):
                    print(f"    watch: {line.strip()}")
            print("    json: " + json.dumps(g.to_dict(), sort_keys=True))
        a, b = results["a"], results["b"]
        if a.ratio and b.ratio:
            print(f"\ngoodput auto / fixed = {b.ratio / a.ratio:.3f}")
        if a.step_time_s and a.checkpoint_stall_s:
            mtbf = args.node_mtbf / HOSTS
            restart = a.restart_cost_s or 0.0
            for steps in (args.interval, 10):
                model = expected_goodput(steps * a.step_time_s, a.checkpoint_stall_s, mtbf, restart)
                print(f"model (first order), every {steps} steps: {100 * model:.1f} %")


if __name__ == "__main__":
    main()

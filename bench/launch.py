"""Time from `rlmctl launch` to the first logged training step: Slurm path vs SSH path.

The Slurm cluster of tests/slurm (1 mgmt + 3 compute systemd nodes, real slurmctld/slurmd/munge/
slurmdbd, set up by site.yml) runs `tiny` on 2 nodes × 1 CPU worker twice: once submitted
through Slurm (`rlm_scheduler: slurm`: sbatch, the Prolog gate, srun, one torchrun per node),
once started over SSH on the same two nodes (`rlm_scheduler: ssh`: rlmctl's health gate, then
torchrun in a transient unit per host). The time runs from the moment `rlmctl launch` is
started to the wall-clock time of the first `train` record in metrics.jsonl (rank 0 writes it
after step 1). Prints both, each of REPEATS launches, and the ratio.

Then, under Slurm with `rlmctl watch`: the trainer SIGKILLed on one node of a 2-node job (once it
has a checkpoint), and the time from the kill to the first step the resubmitted job trains, in
parts: detect (to watch's `failure` event), resubmit (to the resume's `launched` event, written
before its sbatch), queue (to the new job's start in sacct: scheduling and the Prolog gate) and
start-up (to its first train record: srun, torchrun's rendezvous, the checkpoint loaded).
Asserts nothing. Needs root (the rig); uses RLM_RIG_ID (default 0), slot 9.

    RLM_RIG_ID=7 .venv/bin/python bench/launch.py   (as root)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/launch.py` puts only bench/ on the path

from runcontract.states import EventKind  # noqa: E402
from tests.rig import Rig  # noqa: E402
from tests.slurm import slurm_rig  # noqa: E402
from trainer.rundir import RunDir  # noqa: E402

SLOT = 9
REPEATS = 2
TINY = ["data.path=data", "train.global_batch=8", "train.micro_batch=2", "metrics.log_every=1"]
CONFIG = str(REPO / "trainer/configs/tiny.yaml")


def rlmctl(inventory: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlmctl", "-i", str(inventory), *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        check=False,
    )


def first_step_seconds(inventory: Path, run_dir: Path, name: str, limit: list[str]) -> float:
    """Seconds from starting `rlmctl launch` to the first train record of the run."""
    started = time.time()
    argv = [*limit, "launch", "--config", CONFIG, "--name", name, "--nodes", "2"]
    result = rlmctl(inventory, *argv, *TINY, "train.steps=100000")
    if result.returncode != 0:
        raise SystemExit(f"launch {name} failed: {result.stderr.strip()}")
    run = RunDir(run_dir / name)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        train = [r for r in run.read_metrics() if r.get("kind") == "train"]
        if train:
            seconds = float(train[0]["time"]) - started
            break
        time.sleep(0.2)  # polling the run directory, not a synchronisation
    else:
        raise SystemExit(f"run {name}: no training step within 600 s")
    stopped = rlmctl(inventory, *limit, "stop", name, "--timeout", "60")
    if stopped.returncode != 0:
        raise SystemExit(f"stop {name} failed: {stopped.stdout}{stopped.stderr}")
    return seconds


def controller_seconds(rig: Rig, when: str) -> float:
    """A time sacct printed (the controller's local time) as seconds since the epoch."""
    return float(rig.exec("node1", f"date -d '{when}' +%s").stdout)


def kill_to_training_again(rig: Rig, inventory: Path, runs: Path, name: str) -> dict[str, float]:
    """The kill-to-training-again time under Slurm and its parts (the module's docstring)."""
    overrides = [*TINY, "train.steps=100000", "checkpoint.interval_steps=5"]
    argv = ["launch", "--config", CONFIG, "--name", name, "--nodes", "2"]
    launched = rlmctl(inventory, *argv, *overrides)
    if launched.returncode != 0:
        raise SystemExit(f"launch {name} failed: {launched.stderr.strip()}")
    watch = ["watch", name, "--poll", "1", "--backoff", "1", "--stall", "300"]
    watcher = subprocess.Popen(
        [sys.executable, "-m", "rlmctl", "-i", str(inventory), *watch],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run = RunDir(runs / name)
    try:
        deadline = time.monotonic() + 600
        while run.latest_valid_checkpoint() is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"run {name}: no checkpoint within 600 s")
            time.sleep(0.5)  # polling the run directory, not a synchronisation
        job = json.loads((run.path / "slurm.json").read_text())["job_id"]
        nodelist = rig.exec("node1", f"squeue --noheader --jobs {job} --format=%N").stdout
        nodes = rig.exec("node1", f"scontrol show hostnames {nodelist.strip()}").stdout.split()
        rig.exec(nodes[-1], "pkill -KILL -f '[t]rainer train'")
        killed = time.time()  # the nodes share the host's clock
        parts: dict[str, float] = {}
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            events = [e for e in run.events() if e.time >= killed]
            failure = next((e for e in events if e.kind == EventKind.FAILURE), None)
            resumed = next((e for e in events if e.kind == EventKind.LAUNCHED), None)
            train = [
                r
                for r in run.read_metrics()
                if r.get("kind") == "train" and resumed and float(r["time"]) > resumed.time
            ]
            if failure and resumed and train:
                again = json.loads((run.path / "slurm.json").read_text())["job_id"]
                start = rig.exec(
                    "node1", f"sacct --noheader --parsable2 --allocations --jobs {again} -o Start"
                ).stdout.strip()
                running = controller_seconds(rig, start)
                first = float(train[0]["time"])
                parts = {
                    "detect": failure.time - killed,
                    "resubmit": resumed.time - failure.time,
                    "queue": running - resumed.time,
                    "start-up": first - running,
                    "total": first - killed,
                }
                break
            time.sleep(0.5)  # polling the run directory, not a synchronisation
        else:
            raise SystemExit(f"run {name}: not training again within 900 s of the kill")
    finally:
        watcher.terminate()
        watcher.wait(timeout=60)
    stopped = rlmctl(inventory, "stop", name, "--timeout", "60")
    if stopped.returncode != 0:
        raise SystemExit(f"stop {name} failed: {stopped.stdout}{stopped.stderr}")
    return parts


def main() -> None:
    os.environ.setdefault("RLM_RIG_ID", "0")
    work = Path(os.environ.get("RLM_BENCH_WORK", "/tmp/rlm-bench-launch"))
    work.mkdir(parents=True, exist_ok=True)
    with Rig(slurm_rig.NODES, slot=SLOT, release="bookworm") as rig:
        slurm = slurm_rig.provision(rig, work)  # no test hooks: the trainer as shipped
        ssh_vars = yaml.safe_load(slurm.read_text())
        ssh_vars["all"]["vars"]["rlm_scheduler"] = "ssh"
        ssh = work / "ssh.yml"
        ssh.write_text(yaml.safe_dump(ssh_vars))
        runs = rig.shared_dir / "runs"
        figures: dict[str, list[float]] = {"slurm": [], "ssh": []}
        for i in range(REPEATS):
            figures["slurm"].append(first_step_seconds(slurm, runs, f"bench-slurm-{i}", []))
            limit = ["--limit", "node2,node3"]
            figures["ssh"].append(first_step_seconds(ssh, runs, f"bench-ssh-{i}", limit))
        again = kill_to_training_again(rig, slurm, runs, "bench-slurm-kill")
        load = os.getloadavg()[0]
    for path, values in figures.items():
        shown = ", ".join(f"{v:.1f}" for v in values)
        print(
            f"{path:>5}: launch -> first step {statistics.median(values):.1f} s (median; {shown})"
        )
    ratio = statistics.median(figures["slurm"]) / statistics.median(figures["ssh"])
    print(f"ratio slurm/ssh: {ratio:.2f} (2 rig nodes, 1 CPU worker each; load {load:.1f})")
    shown = ", ".join(f"{part} {seconds:.1f} s" for part, seconds in again.items())
    print(f"slurm: kill -> training again: {shown}")
    summary = {"slurm_s": figures["slurm"], "ssh_s": figures["ssh"], "ratio": ratio}
    print(json.dumps({**summary, "kill_to_training_again_s": again}))


if __name__ == "__main__":
    main()

"""Time from `rlmctl launch` to the first logged training step: Slurm path vs SSH path.

The Slurm cluster of tests/slurm (1 mgmt + 3 compute systemd nodes, real slurmctld/slurmd/munge/
slurmdbd, set up by site.yml) runs `tiny` on 2 nodes × 1 CPU worker twice: once submitted
through Slurm (`rlm_scheduler: slurm`: sbatch, the Prolog gate, srun, one torchrun per node),
once started over SSH on the same two nodes (`rlm_scheduler: ssh`: rlmctl's health gate, then
torchrun in a transient unit per host). The time runs from the moment `rlmctl launch` is
started to the wall-clock time of the first `train` record in metrics.jsonl (rank 0 writes it
after step 1). Prints both, each of REPEATS launches, and the ratio; asserts nothing. Needs root
(the rig); uses RLM_RIG_ID (default 0), slot 9.

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

from tests.ansible.playbook_run import run_playbook, write_inventory  # noqa: E402
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


def main() -> None:
    os.environ.setdefault("RLM_RIG_ID", "0")
    work = Path(os.environ.get("RLM_BENCH_WORK", "/tmp/rlm-bench-launch"))
    work.mkdir(parents=True, exist_ok=True)
    with Rig(slurm_rig.NODES, slot=SLOT, release="bookworm") as rig:
        for name in slurm_rig.COMPUTE:
            slurm_rig.remount_cgroups_writable(rig, name)
        inventory = slurm_rig.slurm_inventory(rig, work)
        inventory["all"]["vars"].pop("rlm_comm_env")  # no test hooks: the trainer as shipped
        slurm = write_inventory(work / "slurm.yml", inventory)
        site = run_playbook("site.yml", slurm, work, tags=slurm_rig.SITE_TAGS, timeout=1200)
        if site.rc != 0:
            raise SystemExit(f"site.yml failed: {site.stderr[-2000:]}")
        slurm_rig.prepare_corpus(rig, REPO)
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
        load = os.getloadavg()[0]
    for path, values in figures.items():
        shown = ", ".join(f"{v:.1f}" for v in values)
        print(
            f"{path:>5}: launch -> first step {statistics.median(values):.1f} s (median; {shown})"
        )
    ratio = statistics.median(figures["slurm"]) / statistics.median(figures["ssh"])
    print(f"ratio slurm/ssh: {ratio:.2f} (2 rig nodes, 1 CPU worker each; load {load:.1f})")
    print(json.dumps({"slurm_s": figures["slurm"], "ssh_s": figures["ssh"], "ratio": ratio}))


if __name__ == "__main__":
    main()

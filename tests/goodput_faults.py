"""Faults for the goodput tests and benchmark, on top of tests/trainer/faults.py: a rank that dies
once at a chosen step (a lost node: SIGKILL, no checkpoint, no last word) and a host whose ranks
are slow (the hooks are switched on per host through rlm_comm_env, where rank numbers are not
known in advance). Trainer subprocesses import it from their working directory (`install`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.trainer.faults import Faults
from trainer.hooks import HOOKS_ENV

GOODPUT_FAULTS_ENV = "RLM_TEST_GOODPUT_FAULTS"
FILES = (
    "tests/__init__.py",
    "tests/goodput_faults.py",
    "tests/trainer/__init__.py",
    "tests/trainer/faults.py",
    "tests/trainer/file_opens.py",
)


@dataclass
class GoodputFaults(Faults):
    # This rank dies by SIGKILL before step `kill_step` (0-based: after `kill_step` steps), once
    # per run directory (a marker file): the restarted attempt goes past it.
    kill_step: int = -1
    kill_on_rank: int = -1
    kill_here: bool = False  # whatever rank this process is (faults set per host)
    # Every rank of a process with these faults sleeps this long per micro-batch; with
    # `slow_host`, only on the host of that name (under Slurm every node gets one environment).
    slow_here_s: float = 0.0
    slow_host: str = ""

    def on_batch(
        self, run_dir: Path, rank: int, step: int, positions: list[int], indices: list[int]
    ) -> None:
        super().on_batch(run_dir, rank, step, positions, indices)
        if (self.kill_here or rank == self.kill_on_rank) and step == self.kill_step:
            try:
                (run_dir / f"killed-at-{step}").open("x").close()
            except FileExistsError:
                return
            os.kill(os.getpid(), signal.SIGKILL)

    def loss(self, loss, cursor: int, global_batch: int):  # type: ignore[no-untyped-def]
        if self.slow_here_s and self.slow_host in ("", socket.gethostname()):
            time.sleep(self.slow_here_s)
        return super().loss(loss, cursor, global_batch)


def env(**faults: object) -> dict[str, str]:
    """Environment variables (rlm_comm_env) that switch these faults on in a trainer."""
    return {
        HOOKS_ENV: f"{__name__}:from_env",
        GOODPUT_FAULTS_ENV: json.dumps(asdict(GoodputFaults(**faults))),  # type: ignore[arg-type]
    }


def from_env() -> GoodputFaults:
    values = json.loads(os.environ[GOODPUT_FAULTS_ENV])
    tuples = {name: tuple(values[name]) for name in ("nan_steps", "overflow_steps")}
    return GoodputFaults(**{**values, **tuples})


def prepare_data(shared_dir: Path, repo: Path) -> Path:
    """The bundled corpus tokenised for 64-token sequences in `shared_dir`/data (kept when
    another test of the session already made it)."""
    import subprocess
    import sys

    data = shared_dir / "data"
    if not data.exists():
        argv = [sys.executable, "-m", "trainer", "prepare", "--out", str(data), "--seq-len", "64"]
        subprocess.run(argv, check=True, capture_output=True, cwd=repo)
    return data


def install(shared_dir: Path, repo: Path) -> None:
    """These hooks into a shared directory, the trainers' working directory."""
    for name in FILES:
        target = shared_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / name, target)


def rig_inventory(
    rig_inventory_path: Path, out: Path, env_by_host: dict[str, dict[str, str]]
) -> Path:
    """The rig's inventory with `rlm_comm_env` set per host (the faults a host's trainers get)."""
    import yaml

    inventory = yaml.safe_load(rig_inventory_path.read_text(encoding="utf-8"))
    hosts = inventory["all"]["children"]["compute"]["hosts"]
    for name, extra in env_by_host.items():
        hosts[name]["rlm_comm_env"] = dict(extra)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(inventory), encoding="utf-8")
    return out


# Every process of a run on one host (launcher shell, torchrun, workers), by its environment.
_FIND = """import os, sys
run, host = sys.argv[1], sys.argv[2]
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\\0')
    except OSError:
        continue
    if f'RLMCTL_HOST={host}'.encode() in env and f'RLMCTL_RUN={run}'.encode() in env:
        print(pid)
"""


def kill_host(rig, host: str, run_dir: Path) -> list[int]:  # type: ignore[no-untyped-def]
    """SIGKILL every process of the run on `host`, as a node that dies takes them all; the
    PIDs killed (none when nothing of the run was there)."""
    found = rig.exec(host, ["/usr/bin/python3", "-c", _FIND, str(run_dir), host]).stdout.split()
    pids = [int(p) for p in found if p.isdigit() and int(p) != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    return pids

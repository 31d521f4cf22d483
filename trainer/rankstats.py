"""Every rank's step figures, gathered to rank 0 each `metrics.log_every` steps: the input of
straggler detection (runcontract.stragglers).

Synchronous data parallelism makes every rank's step as long as the slowest rank's, so the step
time alone cannot name a straggler. What differs is where the time goes: a slow rank computes
(or loads data) longer and then finds its peers already waiting in the gradient collectives,
while its peers' collectives take as long as they wait for it. So each rank reports its mean
step time, data wait (loading its batch) and collective wait (trainer/commtime.py: the union of
its gradient collectives' intervals), and its own time is the step less the collective wait.

One all-reduce of world × 3 float64 per window (each rank fills its row of a zero tensor; 384 KiB
at 32768 ranks), the same on every rank, on the device the gradients use; rank 0 writes the
window into ranks.json. Hosts are named as the launcher named them (RLMCTL_HOST over SSH,
SLURMD_NODENAME under Slurm, else the host name), once per attempt.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from runcontract.rundir import RunDir
from runcontract.stragglers import RankWindows
from trainer import distributed
from trainer.distributed import DistEnv


def host_name() -> str:
    """The inventory's name of this host where a launcher says it, else its host name."""
    return (
        os.environ.get("RLMCTL_HOST") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    )


class RankTimes:
    """This rank's step, data and collective seconds since the last window (a collective at
    construction: every rank names its host)."""

    def __init__(self, env: DistEnv, run_dir: RunDir, every: int) -> None:
        self.env, self.run_dir, self.every = env, run_dir, every
        hosts = distributed.gather_objects(host_name(), env)
        self.windows = RankWindows(hosts=list(hosts), started=time.time())
        self._sums = [0.0, 0.0, 0.0]
        self._steps = 0

    def add(self, result: object) -> None:
        """One optimizer step's figures (a `StepResult`); a window every `every` steps."""
        step_time = float(getattr(result, "step_time", 0.0))
        data_time = float(getattr(result, "data_time", 0.0))
        comm_time = float(getattr(result, "comm_time", 0.0))
        self._sums = [
            self._sums[0] + step_time,
            self._sums[1] + data_time,
            self._sums[2] + comm_time,
        ]
        self._steps += 1
        step = int(getattr(result, "step", 0))
        if step % self.every == 0:
            self._window(step)

    def _window(self, step: int) -> None:
        steps, self._steps = self._steps, 0
        sums, self._sums = self._sums, [0.0, 0.0, 0.0]
        mine = [value / steps for value in sums] if steps else [0.0, 0.0, 0.0]
        rows = torch.zeros(self.env.world_size, 3, dtype=torch.float64, device=self.env.device)
        rows[self.env.rank] = torch.tensor(mine, dtype=torch.float64)
        if self.env.distributed:
            dist.all_reduce(rows)
        if not self.env.is_main:
            return
        table = rows.cpu().tolist()
        self.windows.add(step, steps, table)
        self.windows.write(self.run_dir)

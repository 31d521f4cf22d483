"""Fault injection for the failure and resume tests, through the trainer's test hooks.

In-process: `train(cfg, hooks=Faults(nan_steps=(4, 5)))`. In a trainer subprocess: the
environment of `faults_env(...)`, which names `from_env` as the hooks factory.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import math
import os
import re
import resource
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tests.trainer.file_opens import opened_files
from trainer.distributed import DistEnv
from trainer.hooks import HOOKS_ENV, TrainHooks
from trainer.rundir import append_jsonl

FAULTS_ENV = "RLM_TEST_FAULTS"


@dataclass
class Faults(TrainHooks):
    # Poison the batches an uninterrupted run trains at these steps (1-based). The poison follows
    # the data, like a bad shard would: a rollback that moves the cursor past it does not meet it.
    nan_steps: tuple[int, ...] = ()
    # Multiply the loss at these steps (1-based) by 1e30: finite in fp32, but its fp16 gradients
    # overflow, which the fp16 loss scaler must catch (skip the step, lower the scale).
    overflow_steps: tuple[int, ...] = ()
    # Each rank appends the global sample positions of every step to run_dir/ledger-rank<r>.jsonl.
    ledger: bool = False
    # This rank hangs before the startup check, like a stuck worker; SIGTERM still ends it.
    stall_rank: int = -1
    # This rank gets an I/O error reading the checkpoint files that match one of these globs
    # (relative to run_dir/checkpoints, e.g. "step-00000004/dcp/*.distcp"): a bad disk block, a
    # stale network-filesystem handle. The other ranks read them fine.
    read_error_rank: int = -1
    read_error_files: tuple[str, ...] = ()
    # This rank's writes of its shard files (sharded checkpoints) at these steps fail with ENOSPC,
    # as on a full disk or an exhausted quota of the filesystem that rank writes to.
    write_error_rank: int = -1
    write_error_steps: tuple[int, ...] = ()
    # This rank dies by SIGKILL when its checkpoint save reaches this phase, e.g.
    # "shards-written:4" (trainer/checkpoint.py names the phases).
    kill_rank: int = -1
    kill_phase: str = ""
    # When rank 0's save reaches this phase (e.g. "tmp-created" of an async save), it writes the
    # file `stall_marker` and blocks for good, like a save stuck on a hung filesystem.
    stall_phase: str = ""
    stall_marker: str = ""
    # Before every step each rank appends to run_dir/memory-rank<r>.jsonl its resident memory
    # just before the model was built and its peak resident memory so far (the kernel's figures).
    memory: bool = False
    # Each rank records every file under run_dir/checkpoints it opens read-only during setup
    # (the resume) and writes them to run_dir/opens-rank<r>.json before its first step.
    checkpoint_reads: bool = False
    # This rank sleeps this long between each micro-batch's forward and backward, like a peer on a
    # slow host: the other ranks then wait for it inside the gradient collectives.
    slow_rank: int = -1
    slow_s: float = 0.0

    def before_startup_check(self, env: DistEnv) -> None:
        self.rss_before_model = resident_bytes()  # the model is built right after this check
        if self.checkpoint_reads:
            self.opens = contextlib.ExitStack()  # the run directory is known at the first step
            self.reads = self.opens.enter_context(opened_files(Path("/")))
        if env.world_size > 1 and env.rank == self.stall_rank:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            threading.Event().wait()

    def on_batch(
        self, run_dir: Path, rank: int, step: int, positions: list[int], indices: list[int]
    ) -> None:
        self.rank = rank
        if self.ledger:
            record = {"step": step, "positions": positions, "indices": indices}
            append_jsonl(run_dir / f"ledger-rank{rank}.jsonl", record)
        if self.checkpoint_reads and step == self.first_step(step):
            self.opens.close()
            checkpoints = (run_dir / "checkpoints").resolve()
            reads = [p for p in self.reads.read() if p.is_relative_to(checkpoints)]
            names = [str(p.relative_to(checkpoints)) for p in reads]
            (run_dir / f"opens-rank{rank}.json").write_text(json.dumps(names))
        if self.memory:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
            record = {
                "step": step,
                "before_model": self.rss_before_model,
                "peak": peak,
                "now": resident_bytes(),
            }
            append_jsonl(run_dir / f"memory-rank{rank}.jsonl", record)

    def first_step(self, step: int) -> int:
        if not hasattr(self, "_first_step"):
            self._first_step = step
        return self._first_step

    def on_checkpoint_read(self, rank: int, path: Path) -> None:
        if rank != self.read_error_rank or "checkpoints" not in path.parts:
            return
        inside = "/".join(path.parts[path.parts.index("checkpoints") + 1 :])
        if any(fnmatch.fnmatch(inside, pattern) for pattern in self.read_error_files):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

    def on_checkpoint_write(self, rank: int, path: Path) -> None:
        if rank != self.write_error_rank:
            return
        saving = re.search(r"step-(\d{8})", str(path))
        if saving and int(saving.group(1)) in self.write_error_steps:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def on_checkpoint_phase(self, rank: int, phase: str) -> None:
        if rank == self.kill_rank and phase == self.kill_phase:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0 and phase == self.stall_phase:
            Path(self.stall_marker).write_text(phase)
            threading.Event().wait()

    def loss(self, loss: torch.Tensor, cursor: int, global_batch: int) -> torch.Tensor:
        if getattr(self, "rank", None) == self.slow_rank:
            time.sleep(self.slow_s)
        step = cursor // global_batch + 1
        if step in self.overflow_steps:
            return loss * 1e30
        return loss * math.nan if step in self.nan_steps else loss


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def faults_env(**faults: object) -> dict[str, str]:
    """Environment variables that make a trainer subprocess inject `Faults(**faults)`."""
    return {
        HOOKS_ENV: f"{__name__}:from_env",
        FAULTS_ENV: json.dumps(asdict(Faults(**faults))),  # type: ignore[arg-type]
    }


def from_env() -> Faults:
    values = json.loads(os.environ[FAULTS_ENV])
    names = ("nan_steps", "overflow_steps", "write_error_steps", "read_error_files")
    tuples = {name: tuple(values[name]) for name in names}
    return Faults(**{**values, **tuples})

"""Helpers to start real training runs from the trainer tests (in-process, CLI, torchrun)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from trainer.config import Config, load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "trainer" / "configs" / "tiny.yaml"
# The smallest useful run: tiny model at depth ~2, 8 samples of 64 tokens per step, fp32.
FAST = ["model.mean_recurrence=2", "train.global_batch=8", "train.micro_batch=4"]
FAST += ["train.precision=fp32", "eval.every=0", "metrics.log_every=1"]


def overrides(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"data.path={data}", f"run_dir={run_dir}", *FAST, *extra]


def tiny_config(data: Path, run_dir: Path, *extra: str) -> Config:
    return load_config(TINY, overrides(data, run_dir, *extra))


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a trainer subprocess; `extra` adds or overrides variables
    (tests.trainer.faults)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra or {})
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def run_cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m trainer ARGS` as a subprocess, as an operator would run it."""
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO,
        env=cli_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_training(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`python -m trainer train --config tiny.yaml ARGS` in the background with stderr piped, for
    tests that signal or watch a run while it trains."""
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", "train", "--config", str(TINY), *args],
        cwd=REPO,
        env=cli_env(env),
        stderr=subprocess.PIPE,
        text=True,
    )


def torchrun(
    nproc: int, *train_args: str, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`torchrun -m trainer train ARGS` with `nproc` gloo workers on this host."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", "-m", "trainer", "train", *train_args]
    return subprocess.run(
        command, cwd=REPO, env=cli_env(env), capture_output=True, text=True, timeout=timeout
    )


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return torch.load(newest / "model.pt", map_location="cpu", weights_only=True)

"""Gradient averaging at world size 2 with real gloo processes: the DDP comm hook's wire dtypes
and pre-divide, and an fp16 overflow that the loss scaler must skip on every rank."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.trainer.faults import faults_env
from tests.trainer.training_runs import TINY, overrides, torchrun
from trainer import distributed
from trainer.config import CommConfig
from trainer.rundir import RunDir

# (compression, predivide factor): each at world size 2.
SETTINGS = [
    ("none", 1.0),
    ("none", 2.0),
    ("bf16", 1.0),
    ("bf16", 2.0),
    ("fp16", 1.0),
    ("fp16", 2.0),
]


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def rank_input(rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + rank))


def _worker(rank: int, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    env = distributed.DistEnv(rank, 2, rank, torch.device("cpu"), "gloo")
    results = {}
    for compression, factor in SETTINGS:
        model = small_model()
        cfg = CommConfig(compression=compression, predivide_factor=factor)
        ddp = distributed.wrap_model(model, env, cfg, find_unused=False)
        ddp(rank_input(rank)).square().mean().backward()
        grads = [p.grad.flatten().tolist() for p in model.parameters()]
        results[f"{compression}/{factor}"] = {"grads": grads, "bytes": ddp.comm_stats.take()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    # No destroy_process_group(): with a FileStore it hung one rank in about 1 run of 10 here;
    # the process exits, and its sockets with it.
    dist.barrier()


@pytest.fixture(scope="module")
def averaged(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both ranks' gradients for every setting, from one 2-process run."""
    tmp = tmp_path_factory.mktemp("hook")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(str(tmp / "store"), str(tmp)), nprocs=2, join=True)
    return {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.integration
@pytest.mark.parametrize(("compression", "factor"), SETTINGS)
def test_comm_hook_averages_over_two_ranks(averaged: dict, compression: str, factor: float) -> None:
    # The reference: the mean of the two ranks' gradients, computed in fp32 in this process.
    reference = []
    for rank in (0, 1):
        model = small_model()
        model(rank_input(rank)).square().mean().backward()
        reference.append([p.grad.flatten() for p in model.parameters()])
    mean = [(a + b) / 2 for a, b in zip(*reference, strict=True)]
    n_params = sum(t.numel() for t in mean)
    # bf16 keeps 8 mantissa bits, fp16 11: the rounding of a value and of a sum of two.
    rel = {"none": 1e-6, "bf16": 1.6e-2, "fp16": 2e-3}[compression]
    key = f"{compression}/{factor}"
    for rank in (0, 1):
        got = averaged[rank][key]
        assert got["bytes"] == (4 if compression == "none" else 2) * n_params
        for tensor, want in zip(got["grads"], mean, strict=True):
            torch.testing.assert_close(torch.tensor(tensor), want, rtol=rel, atol=rel * 1e-2)
    assert averaged[0][key]["grads"] == averaged[1][key]["grads"], "ranks must agree exactly"


@pytest.mark.integration
def test_fp16_overflow_is_skipped_and_counted_on_both_ranks(
    prepared_data: Path, tmp_path: Path
) -> None:
    run = RunDir(tmp_path / "run")
    args = overrides(prepared_data, run.path, "train.steps=3", "train.precision=fp16")
    result = torchrun(2, "--config", str(TINY), *args, env=faults_env(overflow_steps=(2,)))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [r for r in run.read_metrics() if r["kind"] == "train"]
    scales = [r["loss_scale"] for r in records]
    assert scales[1] == scales[0] / 2, scales  # the overflowing step lowered the scale
    assert scales[2] == scales[1], scales  # and the next one went through
    state = torch.load(run.checkpoint_path(3) / "trainer_state.pt", weights_only=False)
    # GradScaler starts at 2**16, where the first step may overflow by itself: every step whose
    # scale dropped was skipped and counted, the injected one included.
    drops = sum(cur < prev for prev, cur in zip([2.0**16, *scales], scales, strict=False))
    assert state["progress"]["skipped_steps"] == drops >= 1
    assert state["progress"]["nonfinite_steps"] == 0  # a skipped step is not a non-finite one
    assert run.read_status()["state"] == "done"

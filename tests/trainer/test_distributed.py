"""Data parallelism for real: torchrun with gloo workers on this host, and our DDP comm hook."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from clusterspec.vendors import nvidia
from tests.trainer.training_runs import REPO, TINY, final_weights, overrides, tiny_config, torchrun
from trainer import distributed
from trainer.config import CommConfig
from trainer.model import RecurrentLM
from trainer.rundir import ExitCode, RunDir
from trainer.train import train


def param_count(cfg_overrides: list[str], data: Path, tmp: Path) -> int:
    return RecurrentLM(tiny_config(data, tmp, *cfg_overrides).model).param_counts().total


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in RunDir(run_dir).read_metrics() if r["kind"] == "train"]


@pytest.mark.integration
def test_two_ranks_give_the_same_parameters_as_one(prepared_data: Path, tmp_path: Path) -> None:
    # Same global batch (8 samples) split 1×(2×4) vs 2×(1×4): the math must not notice.
    extra = ("train.steps=3", "comm.compression=none")
    assert train(tiny_config(prepared_data, tmp_path / "one", *extra)) == ExitCode.OK
    result = torchrun(2, "--config", str(TINY), *overrides(prepared_data, tmp_path / "two", *extra))
    assert result.returncode == 0, result.stderr[-3000:]

    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    for name, tensor in one.items():
        # fp32; only the summation order of the gradient average differs.
        torch.testing.assert_close(two[name], tensor, rtol=0, atol=1e-5, msg=name)
    losses_one = [r["loss"] for r in train_records(tmp_path / "one")]
    losses_two = [r["loss"] for r in train_records(tmp_path / "two")]
    assert losses_two == pytest.approx(losses_one, abs=1e-5)
    n_params = param_count([], prepared_data, tmp_path / "x")
    assert {r["comm_bytes"] for r in train_records(tmp_path / "two")} == {4 * n_params}


@pytest.mark.integration
def test_bf16_compression_halves_the_bytes_and_still_learns(
    prepared_data: Path, tmp_path: Path
) -> None:
    extra = ("train.steps=8", "comm.compression=bf16", "optim.lr=1e-2", "optim.warmup_steps=2")
    result = torchrun(2, "--config", str(TINY), *overrides(prepared_data, tmp_path / "run", *extra))
    assert result.returncode == 0, result.stderr[-3000:]
    records = train_records(tmp_path / "run")
    n_params = param_count([], prepared_data, tmp_path / "x")
    assert {r["comm_bytes"] for r in records} == {2 * n_params}  # none sends 4 bytes per param
    assert {r["comm_wire_bytes"] for r in records} == {2 * n_params}  # ring: 2(n-1)/n = 1 at n=2
    assert max(r["loss"] for r in records[-2:]) < records[0]["loss"] - 0.5


@pytest.fixture
def single_rank_group(tmp_path: Path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield distributed.DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("compression", "factor", "bytes_per_param", "atol"),
    [("none", 1.0, 4, 0.0), ("none", 8.0, 4, 1e-7), ("bf16", 4.0, 2, 1e-2), ("fp16", 2.0, 2, 1e-3)],
)
def test_comm_hook_averages_and_counts_bytes(
    single_rank_group: distributed.DistEnv,
    compression: str,
    factor: float,
    bytes_per_param: int,
    atol: float,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reference.load_state_dict(model.state_dict())
    cfg = CommConfig(compression=compression, predivide_factor=factor)
    ddp = distributed.wrap_model(model, single_rank_group, cfg, find_unused=False)
    x = torch.randn(8, 16)
    ddp(x).square().mean().backward()
    reference(x).square().mean().backward()
    stats = distributed.comm_stats(ddp)
    n_params = sum(p.numel() for p in model.parameters())
    assert stats.take() == bytes_per_param * n_params
    assert stats.take() == 0  # reset once read
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=0.01 if atol else 0, atol=atol)


# Where the trainer may still spell a device type: the user-facing values of train.device.
DEVICE_NAMES_ALLOWED = {"config.py": 'device: Literal["auto", "cpu", "cuda"]'}


def test_device_type_and_backend_come_from_the_one_vendor_lookup() -> None:
    """A new GPU vendor is one description (clusterspec/vendors) plus its roles: no trainer
    module names a device type or backend ("cuda", "nccl") or calls torch.cuda itself; they all
    go through trainer.distributed.accelerator()."""
    gpu = distributed.accelerator()
    assert (gpu.device_type, gpu.backend) == (nvidia.TORCH_DEVICE, nvidia.DIST_BACKEND)
    pattern = re.compile(r"""["'](cuda|nccl|rccl)["']|torch\.cuda\b""")
    found = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            allowed = DEVICE_NAMES_ALLOWED.get(path.name)
            if pattern.search(line) and not (allowed and allowed in line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "use trainer.distributed.accelerator() instead:\n" + "\n".join(found)


@pytest.mark.integration
def test_two_rank_workers_exit_when_the_run_is_done(prepared_data: Path, tmp_path: Path) -> None:
    """Found by `make demo`: a run recorded `done` while one gloo worker never exited (DDP's
    Reducer freed as the process group's last owner joins gloo's threads with the GIL held).
    The demo's shape and threads (torch's default OMP threads), checkpoints and evaluations."""
    args = ["--config", str(TINY), f"data.path={prepared_data}", "train.steps=30"]
    args += ["train.global_batch=16", "train.micro_batch=8"]
    args += ["checkpoint.interval_steps=10", "eval.every=10", "eval.batches=1"]
    threads = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    for attempt in range(3):  # a race: the demo hit it in 2 of 2 runs
        run_dir = tmp_path / f"run-{attempt}"
        # torchrun's timeout raises TimeoutExpired (the test fails) when a worker hangs at exit.
        result = torchrun(2, *args, f"run_dir={run_dir}", timeout=240, env=threads)
        assert result.returncode == 0, result.stderr[-2000:]
        assert RunDir(run_dir).read_status()["state"] == "done"

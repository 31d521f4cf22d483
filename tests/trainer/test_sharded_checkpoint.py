"""Sharded (DCP) checkpoints with real torchrun gloo workers: resume onto other world sizes and
strategies without repeating or skipping a sample, and SIGKILL during an async sharded save."""

from __future__ import annotations

import json
import math
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from tests.trainer.faults import Faults, faults_env
from tests.trainer.file_opens import opened_files
from tests.trainer.training_runs import TINY, overrides, tiny_config, torchrun
from trainer import sharded_checkpoint
from trainer.checkpoint import CheckpointConfig, CheckpointStore
from trainer.export import export_checkpoint, load_exported
from trainer.generate import generate_text
from trainer.model import PRESETS, RecurrentLM
from trainer.rundir import (
    MANIFEST_NAME,
    ExitCode,
    RunDir,
    read_json,
    read_jsonl,
    sha256_file,
    verify_checkpoint,
)
from trainer.train import train

# 12 samples per step: 2 ranks × 3 micro-batches of 2, 3 ranks × 2, or 1 process × 6.
COMMON = ["train.global_batch=12", "train.micro_batch=2", "checkpoint.keep_last=0"]
# A constant learning rate after warmup, so that stopping at train.steps=N changes nothing.
COMMON += ["optim.warmup_steps=2", "optim.min_lr_ratio=1.0", "checkpoint.interval_steps=2"]
SHARDED = [*COMMON, "checkpoint.format=sharded"]
GLOBAL_BATCH = 12


def in_process(data: Path, run_dir: Path, *extra: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train(tiny_config(data, run_dir, *extra), hooks=Faults(ledger=True)) == ExitCode.OK
    finally:
        torch.set_num_threads(threads)


def two_or_three(nproc: int, data: Path, run_dir: Path, *extra: str) -> str:
    result = torchrun(
        nproc,
        "--config",
        str(TINY),
        *overrides(data, run_dir, *extra),
        timeout=300,
        env=faults_env(ledger=True),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def losses(run_dir: Path) -> dict[int, float]:
    records = [r for r in RunDir(run_dir).read_metrics() if r.get("kind") == "train"]
    return {r["step"]: r["loss"] for r in records}


def positions_by_step(run_dir: Path) -> dict[int, list[int]]:
    by_step: dict[int, list[int]] = {}
    for path in sorted(run_dir.glob("ledger-rank*.jsonl")):
        for record in read_jsonl(path):
            by_step.setdefault(record["step"], []).extend(record["positions"])
    return by_step


def one_rank_state() -> dict:
    """A tiny model after one AdamW step, as a single-rank sharded save holds it."""
    torch.manual_seed(0)
    model = RecurrentLM(PRESETS["tiny"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16))
    model(ids, labels=ids, num_steps=2).loss.backward()
    optimizer.step()
    rest = {"progress": {"step": 1}, "config": {}, "version": "test"}
    return {**sharded_checkpoint.tensor_state(model, optimizer), **rest}


def test_sharded_save_hashes_while_writing_and_reads_nothing_back(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").create()
    state = one_rank_state()
    for async_save in (False, True):
        cfg = CheckpointConfig(format="sharded", async_save=async_save, keep_last=0)
        store = CheckpointStore(run, cfg, 0, 1)
        step = 2 if async_save else 1
        with warnings.catch_warnings(), opened_files(run.checkpoints_dir) as opens:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            assert store.save(step, state)
            store.wait()
        assert store.failures == 0
        path = run.checkpoint_path(step)
        written = {p.name for p in opens.written()}
        # Two files per rank, written (and hashed) by two threads.
        shards = {"__0_0.distcp", "__0_1.distcp"}
        assert shards | {".metadata.tmp", "trainer_state.pt"} <= written, written
        # The manifest's sha256 came from the writes: no file was opened to be read back (only
        # manifests, which retention reads to list the checkpoints).
        read_back = [p for p in opens.read() if p.name != MANIFEST_NAME]
        assert read_back == [], read_back
        manifest = read_json(path / MANIFEST_NAME)
        assert sorted(manifest["files"]) == [
            "dcp/.metadata",
            "dcp/__0_0.distcp",
            "dcp/__0_1.distcp",
            "trainer_state.pt",
        ]
        for name, entry in manifest["files"].items():
            assert entry["sha256"] == sha256_file(path / name), name
        assert verify_checkpoint(path, full=True).valid


def test_a_sharded_save_checks_free_space_before_writing(tmp_path: Path) -> None:
    """checkpoint.min_free_bytes (and a disk too small for the state) were checked for full
    saves only: a sharded save started writing into a disk it could not fit on."""
    run = RunDir(tmp_path / "run").create()
    cfg = CheckpointConfig(format="sharded", min_free_bytes=10**18)
    store = CheckpointStore(run, cfg, 0, 1)
    assert not store.save(1, one_rank_state())
    store.wait()
    assert store.failures == 1
    assert list(run.checkpoints_dir.iterdir()) == []  # nothing written, no temp directory
    (event,) = [e for e in run.events() if e.kind == "checkpoint_failed"]
    assert "needs about" in event.fields["error"] and "free" in event.fields["error"], event


def test_async_sharded_save_writes_the_tensors_as_they_were_at_save(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").create()
    state = one_rank_state()
    saved = {name: tensor.clone() for name, tensor in state["model"].items()}
    # 128 MiB staged first: without the wait below the weights would change before their copy.
    state["model"] = {"padding": torch.zeros(32 << 20), **state["model"]}
    store = CheckpointStore(run, CheckpointConfig(format="sharded", async_save=True), 0, 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        assert store.save(1, state)
        # DCP's stager copies the tensors in its own thread; the optimizer step waits for that
        # copy (as the training loop does), then changes them in place while DCP writes.
        store.wait_for_staging()
        for name in saved:
            state["model"][name].add_(1.0)
        store.wait()
    assert store.failures == 0
    model = RecurrentLM(PRESETS["tiny"])
    sharded_checkpoint.read_model_weights(run.checkpoint_path(1), model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


@pytest.mark.integration
def test_resume_across_world_sizes_and_strategies(prepared_data: Path, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    in_process(prepared_data, reference, "train.steps=10", *COMMON)
    run = tmp_path / "run"
    hops: list[tuple[int, str]] = [(2, "ddp"), (2, "fsdp"), (3, "fsdp"), (2, "fsdp")]
    for i, (nproc, strategy) in enumerate(hops):
        steps = 2 * (i + 1)
        stderr = two_or_three(
            nproc,
            prepared_data,
            run,
            f"train.steps={steps}",
            f"parallel.strategy={strategy}",
            *SHARDED,
        )
        if i:
            assert f"resumed at step {steps - 2}" in stderr
        files = sorted(p.name for p in (RunDir(run).checkpoint_path(steps) / "dcp").iterdir())
        shards = [f"__{r}_{n}.distcp" for r in range(nproc) for n in range(2)]
        assert files == [".metadata", *shards], files
    in_process(prepared_data, run, "train.steps=10", *SHARDED)  # fsdp -> one process
    assert all(verify_checkpoint(c.path, full=True).valid for c in RunDir(run).checkpoints())

    # The ledger: every global sample position of the 10 steps trained exactly once.
    by_step = positions_by_step(run)
    assert sorted(by_step) == list(range(10))
    for step, positions in by_step.items():
        assert sorted(positions) == list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
    # Same samples, same per-sample noise, same schedule: only the reduction order differs
    # (measured ~1e-6 relative in tests/trainer/test_parallel.py); 1e-4 leaves margin, while a
    # wrong optimizer state or lost step moves the loss by ~1e-2.
    ref = losses(reference)
    got = losses(run)
    assert sorted(got) == list(range(1, 11))
    for step, loss in got.items():
        assert math.isclose(loss, ref[step], rel_tol=1e-4), (step, loss, ref[step])


@pytest.mark.integration
def test_each_rank_reads_only_its_own_shards_at_resume(prepared_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    layout = ["parallel.strategy=fsdp", *SHARDED]
    two_or_three(2, prepared_data, run, "train.steps=2", *layout)
    args = overrides(prepared_data, run, "train.steps=3", *layout)
    # What each rank opens, recorded by the interpreter's audit hook in the trainer processes.
    result = torchrun(
        2, "--config", str(TINY), *args, timeout=300, env=faults_env(checkpoint_reads=True)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed at step 2" in result.stderr
    # DCP's own index of the checkpoint: which entry lies in which file.
    with open(RunDir(run).checkpoint_path(2) / "dcp" / ".metadata", "rb") as f:
        index = pickle.load(f).storage_data
    for rank in (0, 1):
        reads = json.loads((run / f"opens-rank{rank}.json").read_text())
        assert all(name.startswith("step-00000002/") for name in reads), reads
        assert "step-00000002/dcp/.metadata" in reads, reads
        own = {f"step-00000002/dcp/__{rank}_{n}.distcp" for n in range(2)}
        assert own <= set(reads), reads
        # Values every rank holds (AdamW's step counters, param_groups) are stored once, in
        # whichever rank's file DCP's dedup picked: a rank opens another's file only for those,
        # small next to the shards it holds (it reads byte ranges, not whole files).
        for other in [n for n in reads if n.endswith(".distcp") and n not in own]:
            entries = [(i, s) for i, s in index.items() if s.relative_path == Path(other).name]
            replicated = sum(s.length for i, s in entries if not i.offset)
            assert replicated < 0.05 * sum(s.length for _, s in entries), (other, replicated)

    # Export and generation read a sharded checkpoint in one process: the 2 ranks' shards
    # reassembled equal the weights of the same 2 steps trained by one process.
    reference = tmp_path / "reference"
    in_process(prepared_data, reference, "train.steps=2", *COMMON)
    expected = torch.load(
        RunDir(reference).checkpoint_path(2) / "model.pt", map_location="cpu", weights_only=True
    )
    export_checkpoint(RunDir(run).checkpoint_path(2), tmp_path / "export")
    exported = load_exported(tmp_path / "export").state_dict()
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-5)  # reduction order
    generation = generate_text(RunDir(run).checkpoint_path(2), "The module", 2, max_new_tokens=4)
    assert len(generation.tokens) == 4, generation


@pytest.mark.integration
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_sigkill_of_one_rank_during_a_sharded_save_keeps_the_previous_checkpoint(
    prepared_data: Path, tmp_path: Path, async_save: bool
) -> None:
    run = RunDir(tmp_path / "run")
    args = overrides(
        prepared_data,
        run.path,
        "train.steps=4",
        "parallel.strategy=fsdp",
        f"checkpoint.async_save={str(async_save).lower()}",
        *SHARDED,
    )
    # Rank 1 dies after writing its shards of step 4, before rank 0 can publish them.
    faults = faults_env(kill_rank=1, kill_phase="shards-written:4")
    result = torchrun(2, "--config", str(TINY), *args, timeout=300, env=faults)
    assert result.returncode != 0
    # Rank 0 finds its peer gone and records the truth: failed, restartable.
    status = run.status()
    assert status.state.value == "failed" and status.exit_code == ExitCode.FAILED, status
    assert [e.fields["exit_code"] for e in run.events() if e.kind == "exit"] == [1]
    assert [c.step for c in run.checkpoints()] == [2]
    assert verify_checkpoint(run.checkpoint_path(2), full=True).valid
    # Rank 0 gave the save up and removed its hidden temp directory.
    assert not [p.name for p in run.checkpoints_dir.iterdir() if p.name.startswith(".tmp-")]
    (line,) = [x for x in result.stderr.splitlines() if "checkpoint step-00000004 not saved" in x]
    assert "lost its peers" in line, line

    in_process(prepared_data, run.path, "train.steps=4", *SHARDED)
    assert [c.step for c in run.checkpoints() if c.valid] == [2, 4]
    # Steps 3 and 4 trained before the kill, and again after resuming from step 2.
    steps = [r["step"] for r in run.read_metrics() if r.get("kind") == "train"]
    assert steps == [1, 2, 3, 4, 3, 4], steps

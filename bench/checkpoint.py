"""Checkpoint benchmark: save vs raw write, async stall vs sync, load time (prints figures).

Full checkpoints (rank 0 writes model.pt/optimizer.pt) and sharded ones (checkpoint.format=
sharded: torch.distributed.checkpoint, here in one process, i.e. what each rank does for its own
shards), each sync and async.

A synthetic training state of about 300 MB (fp32 weights plus two AdamW moments) is saved by
CheckpointStore and compared with writing the same tensor bytes straight to disk (write + fsync).
The async figure is the time the training thread spends blocked inside `save()`; while the
background write runs, a CPU matmul loop stands in for training and its slowdown is printed too.

    python bench/checkpoint.py [--mb 300] [--dir DIR] [--repeats 3]

Times are the best of --repeats runs: on a shared machine the minimum is the figure least
disturbed by other work.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import CheckpointConfig, CheckpointStore, state_nbytes
from trainer.rundir import RunDir


def synthetic_state(total_mb: int) -> dict[str, Any]:
    """Weights of total_mb/3 in 4 MiB..16 MiB matrices, plus exp_avg/exp_avg_sq of the same size."""
    per_group = total_mb * 2**20 // 3
    shapes, used = [], 0
    while used < per_group:
        rows = min(2048, max(1, (per_group - used) // (4 * 1024)))
        shapes.append((rows, 1024))
        used += rows * 1024 * 4
    model = {f"layer{i}.weight": torch.randn(s) for i, s in enumerate(shapes)}
    optimizer = {
        "state": {
            i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(s), "exp_avg_sq": torch.rand(s)}
            for i, s in enumerate(shapes)
        },
        "param_groups": [{"lr": 3e-4, "params": list(range(len(shapes)))}],
    }
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": {"last_epoch": 10},
        "progress": {"step": 10, "tokens": 1 << 20},
        "config": {},
        "version": "bench",
    }


def raw_write(state: dict[str, Any], path: Path) -> float:
    """Seconds to write every tensor's bytes to one file and fsync it: the floor for a save."""
    tensors = list(state["model"].values())
    for entry in state["optimizer"]["state"].values():
        tensors += [entry["exp_avg"], entry["exp_avg_sq"]]
    start = time.perf_counter()
    with open(path, "wb") as f:
        for t in tensors:
            f.write(memoryview(t.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def busy_loop(stop: threading.Event, done: list[int]) -> None:
    """Stands in for training: counts 256x256 matmuls until told to stop."""
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)
        done[0] += 1


def matmul_rate(seconds: float) -> float:
    stop, done = threading.Event(), [0]
    worker = threading.Thread(target=busy_loop, args=(stop, done))
    worker.start()
    time.sleep(seconds)  # a measurement window, not synchronisation
    stop.set()
    worker.join()
    return done[0] / seconds


def sharded_figures(state: dict[str, Any], base: Path, raw_s: float, repeats: int) -> None:
    """checkpoint.format=sharded, sync and async: DCP writes, per-rank sha256, manifest, rename."""
    # DCP addresses state by name: parameter indices become strings, as named optimizer state.
    optimizer = state["optimizer"]
    named = {
        "state": {f"p{i}": entry for i, entry in optimizer["state"].items()},
        "param_groups": optimizer["param_groups"],
    }
    shard_state = {**state, "optimizer": named}
    nbytes = state_nbytes(shard_state)
    results = {}
    for mode in ("sync", "async"):
        run = RunDir(base / f"sharded-{mode}").create()
        cfg = CheckpointConfig(keep_last=1, format="sharded", async_save=mode == "async")
        store = CheckpointStore(run, cfg, 0, 1)
        blocked, total = [], []
        for step in range(1, repeats + 1):
            start = time.perf_counter()
            assert store.save(step, shard_state)
            blocked.append(time.perf_counter() - start)
            store.wait()
            total.append(time.perf_counter() - start)
            assert store.failures == 0
        results[mode] = (min(blocked), min(total))
    sync_s = results["sync"][0]
    stall_s, async_total = results["async"]
    print(
        f"sharded sync save: {sync_s:6.2f} s ({nbytes / sync_s / 1e6:5.0f} MB/s) = "
        f"{sync_s / raw_s:.2f}x raw (target <= 1.2x)\n"
        f"sharded async    : {stall_s:6.2f} s blocked in save() = {stall_s / sync_s:.1%} of the "
        f"sharded sync save (target <= 10%); {async_total:.2f} s until published"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300, help="approximate state size in MB")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a tmp dir)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    base = Path(tempfile.mkdtemp(prefix="rlm-ckpt-bench-", dir=args.dir))
    try:
        state = synthetic_state(args.mb)
        nbytes = state_nbytes(state)
        print(f"state: {nbytes / 1e6:.0f} MB of tensors, written under {base}")

        raw = [raw_write(state, base / "raw.bin") for _ in range(args.repeats)]
        sync_run = RunDir(base / "sync").create()
        sync = CheckpointStore(sync_run, CheckpointConfig(keep_last=1), 0, 1)
        saves, files, manifests, phases = [], [], [], {}
        sync.phase_hook = lambda phase: phases.setdefault(phase, time.perf_counter())
        for step in range(1, args.repeats + 1):
            phases.clear()
            start = time.perf_counter()
            assert sync.save(step, state)
            saves.append(time.perf_counter() - start)
            files.append(phases["files-written"] - start)
            manifests.append(phases["manifest-written"] - phases["files-written"])
        raw_s, save_s = min(raw), min(saves)
        files_s = min(files)
        print(
            f"raw write+fsync  : {raw_s:6.2f} s ({nbytes / raw_s / 1e6:5.0f} MB/s)\n"
            f"sync save        : {save_s:6.2f} s ({nbytes / save_s / 1e6:5.0f} MB/s)  "
            f"= {save_s / raw_s:.2f}x raw (target <= 1.2x)\n"
            f"  of which torch.save+fsync of the files: {files_s:6.2f} s = {files_s / raw_s:.2f}x "
            f"raw; manifest (sha256 re-read): {min(manifests):.2f} s; rename, retention "
            f"(deleting the previous checkpoint): {save_s - files_s - min(manifests):.2f} s"
        )

        start = time.perf_counter()
        loaded = CheckpointStore(sync_run, CheckpointConfig(), 0, 1).load()
        load_s = time.perf_counter() - start
        assert loaded is not None
        start = time.perf_counter()
        CheckpointStore(sync_run, CheckpointConfig(verify="full"), 0, 1).load()
        load_full_s = time.perf_counter() - start
        print(f"load (verify=size): {load_s:6.2f} s   load (verify=full): {load_full_s:6.2f} s")
        del loaded

        async_run = RunDir(base / "async").create()
        mgr = CheckpointStore(async_run, CheckpointConfig(keep_last=1, async_save=True), 0, 1)
        baseline_rate = matmul_rate(1.0)
        stalls, slowdowns = [], []
        for step in range(1, args.repeats + 1):
            stop, done = threading.Event(), [0]
            start = time.perf_counter()
            assert mgr.save(step, state)
            stalls.append(time.perf_counter() - start)
            worker = threading.Thread(target=busy_loop, args=(stop, done))
            window = time.perf_counter()
            worker.start()
            while mgr.in_flight:
                time.sleep(0.01)  # polling the background save's state
            stop.set()
            worker.join()
            rate = done[0] / (time.perf_counter() - window)
            slowdowns.append(1 - rate / baseline_rate)
            mgr.wait()
        stall_s = min(stalls)
        print(
            f"async save stall : {stall_s:6.2f} s blocked in save() (host copy) = "
            f"{stall_s / save_s:.1%} of the sync save (target <= 10%)\n"
            f"training slowdown while the background write runs: "
            f"{statistics.median(slowdowns):.0%} fewer matmuls/s (CPU box: writer and "
            "trainer share the cores)"
        )
        print(f"async saves: {mgr.saves}, failures: {mgr.failures}")
        sharded_figures(state, base, raw_s, args.repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

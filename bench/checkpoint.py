"""Checkpoint benchmark: save vs raw write, async stall vs sync, load time (prints figures).

Full checkpoints (rank 0 writes model.pt/optimizer.pt) and sharded ones (checkpoint.format=
sharded: torch.distributed.checkpoint, here in one process, i.e. what each rank does for its own
shards), each sync and async.

A synthetic training state of about 300 MB (fp32 weights plus two AdamW moments) is saved by
CheckpointStore and compared with writing the same tensor bytes straight to disk (write + fsync).
The async figure is the time the training thread spends blocked inside `save()`; while the
background write runs, a CPU matmul loop stands in for training and its slowdown is printed too.

    python bench/checkpoint.py [--mb 300] [--dir DIR] [--repeats 5]

Times are the best of --repeats runs: on a shared machine the minimum is the figure least
disturbed by other work. The raw write and the two sync saves run interleaved, round by round,
and the per-round ratios are printed too (each save against the raw write of its own round).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
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


def named_optimizer(state: dict[str, Any]) -> dict[str, Any]:
    """The state as DCP addresses it: parameter indices become names, as named optimizer state."""
    optimizer = state["optimizer"]
    named = {
        "state": {f"p{i}": entry for i, entry in optimizer["state"].items()},
        "param_groups": optimizer["param_groups"],
    }
    return {**state, "optimizer": named}


class TimedStore:
    """A CheckpointStore whose sync saves are timed, with the time of each phase."""

    def __init__(self, run: RunDir, cfg: CheckpointConfig) -> None:
        self.store = CheckpointStore(run, cfg, 0, 1)
        self.phases: dict[str, float] = {}
        self.store.phase_hook = lambda phase: self.phases.setdefault(
            phase.split(":")[0], time.perf_counter()
        )
        self.saves: list[dict[str, float]] = []

    def save(self, step: int, state: dict[str, Any]) -> float:
        self.phases.clear()
        start = time.perf_counter()
        assert self.store.save(step, state)
        end = time.perf_counter()  # a sync save has published its checkpoint when save() returns
        self.store.wait()  # retention's background delete: not the trainer's wait, yet done
        # before the next round so that it does not slow that round's raw write
        assert self.store.failures == 0
        self.saves.append({k: v - start for k, v in self.phases.items()} | {"total": end - start})
        return end - start

    def best(self, phase: str = "total") -> float:
        return min(s[phase] for s in self.saves)


def sync_rounds(state: dict[str, Any], base: Path, repeats: int) -> tuple[float, float, float]:
    """Raw write, full sync save and sharded sync save, interleaved round by round so that all
    three see the same disk and CPU load; the per-round ratios are the figures least disturbed
    by the other work of a shared machine. Returns (raw, full save, sharded save) best seconds."""
    nbytes = state_nbytes(state)
    shard_state = named_optimizer(state)
    full = TimedStore(RunDir(base / "sync").create(), CheckpointConfig(keep_last=1))
    sharded_cfg = CheckpointConfig(keep_last=1, format="sharded")
    sharded = TimedStore(RunDir(base / "sharded-sync").create(), sharded_cfg)
    raws, full_ratios, sharded_ratios = [], [], []
    for step in range(1, repeats + 1):
        raw = raw_write(state, base / "raw.bin")
        raws.append(raw)
        full_ratios.append(full.save(step, state) / raw)
        sharded_ratios.append(sharded.save(step, shard_state) / raw)
    raw_s, full_s, sharded_s = min(raws), full.best(), sharded.best()
    files_s, manifest_s = full.best("files-written"), full.best("manifest-written")
    shards_s, published_s = sharded.best("shards-written"), sharded.best("manifest-written")
    print(
        f"raw write+fsync  : {raw_s:6.2f} s ({nbytes / raw_s / 1e6:5.0f} MB/s)\n"
        f"sync save        : {full_s:6.2f} s ({nbytes / full_s / 1e6:5.0f} MB/s)  "
        f"= {full_s / raw_s:.2f}x raw (best of each); per round median "
        f"{statistics.median(full_ratios):.2f}x (target <= 1.2x)\n"
        f"  of which torch.save+sha256+fsync of the files: {files_s:6.2f} s; "
        f"manifest: {manifest_s - files_s:.2f} s; rename, fsync, retention's rename (it deletes "
        f"the previous checkpoint in the background): {full_s - manifest_s:.2f} s\n"
        f"sharded sync save: {sharded_s:6.2f} s ({nbytes / sharded_s / 1e6:5.0f} MB/s) "
        f"= {sharded_s / raw_s:.2f}x raw (best of each); per round median "
        f"{statistics.median(sharded_ratios):.2f}x (target <= 1.2x)\n"
        f"  of which DCP write+sha256+fsync of the shards: {shards_s:6.2f} s; trainer_state.pt, "
        f"manifest: {published_s - shards_s:.2f} s; rename, fsync, retention's rename: "
        f"{sharded_s - published_s:.2f} s\n"
        f"  per round (raw s, full x, sharded x): "
        + ", ".join(
            f"({r:.2f}, {f:.2f}, {h:.2f})"
            for r, f, h in zip(raws, full_ratios, sharded_ratios, strict=True)
        )
    )
    return raw_s, full_s, sharded_s


WARM_UP_SAVES = 2


def sharded_async(state: dict[str, Any], base: Path, sync_s: float, repeats: int) -> None:
    """checkpoint.format=sharded with async_save: the stall inside save() against a sync save."""
    shard_state = named_optimizer(state)
    run = RunDir(base / "sharded-async").create()
    cfg = CheckpointConfig(keep_last=1, format="sharded", async_save=True)
    store = CheckpointStore(run, cfg, 0, 1)
    blocked, total = [], []
    # DCP stages into fresh host memory until glibc's malloc has raised its mmap threshold past
    # the tensors' size (measured: the first two saves 0.16 s, later ones 0.03 s): those are
    # printed apart, the steady state is the figure a long run sees at every save.
    for step in range(1, repeats + WARM_UP_SAVES + 1):
        start = time.perf_counter()
        assert store.save(step, shard_state)
        blocked.append(time.perf_counter() - start)
        store.wait()
        total.append(time.perf_counter() - start)
        assert store.failures == 0
    stall_s = min(blocked[WARM_UP_SAVES:])
    print(
        f"sharded async    : {stall_s:6.2f} s blocked in save() = {stall_s / sync_s:.1%} of the "
        f"sharded sync save (target <= 10%); {min(total):.2f} s until published; first "
        f"{WARM_UP_SAVES} saves {', '.join(f'{b:.2f}' for b in blocked[:WARM_UP_SAVES])} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300, help="approximate state size in MB")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a tmp dir)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # One process stands for one rank: DCP's "no process group" warning says just that.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    base = Path(tempfile.mkdtemp(prefix="rlm-ckpt-bench-", dir=args.dir))
    try:
        state = synthetic_state(args.mb)
        print(f"state: {state_nbytes(state) / 1e6:.0f} MB of tensors, written under {base}")
        _, save_s, sharded_s = sync_rounds(state, base, args.repeats)

        sync_run = RunDir(base / "sync")
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
        sharded_async(state, base, sharded_s, args.repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

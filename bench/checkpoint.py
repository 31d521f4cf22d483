"""Checkpoint benchmark: save vs raw write, async stall vs sync, load time (prints figures).

Full checkpoints (rank 0 writes model.pt/optimizer.pt) and sharded ones (checkpoint.format=
sharded: torch.distributed.checkpoint, here in one process, i.e. what each rank does for its own
shards), each sync and async.

A synthetic training state of about 300 MB (fp32 weights plus two AdamW moments) is saved by
CheckpointStore and compared with writing the same tensor bytes straight to disk (write + fsync).
The async figure is the time the training loop is blocked by a save, in steady state: the time in
`save()` plus the wait, at the next optimizer step, for the background copy of the tensors to
host memory (`wait_for_staging`), once with that step right after `save()` (the worst case) and
once after a stand-in forward/backward; while the background write runs, a CPU matmul loop
stands in for training and its slowdown is printed too.

    python bench/checkpoint.py [--mb 300] [--dir DIR] [--repeats 5]

Fair comparison: the raw write writes the same tensor bytes from the same memory to the same
file system and fsyncs them, as a save does; before every timed write the bench calls sync(2),
so no operation starts with the dirty pages of the one before it (or of another process) still
being written back. On a shared machine the disk and the cores are noisy: the raw write and the
two sync saves run interleaved (the order rotating round by round), each save is compared with the
raw write of its own round, and the best and the median of each are printed, with the load
average before and after.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer import mapped_state
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


def settled() -> float:
    """sync(2), then the time: a timed write starts with no dirty pages of an earlier one."""
    os.sync()
    return time.perf_counter()


def raw_write(state: dict[str, Any], path: Path) -> float:
    """Seconds to write every tensor's bytes to one file and fsync it: the floor for a save."""
    tensors = list(state["model"].values())
    for entry in state["optimizer"]["state"].values():
        tensors += [entry["exp_avg"], entry["exp_avg_sq"]]
    start = settled()
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
        start = settled()
        assert self.store.save(step, state)
        end = time.perf_counter()  # a sync save has published its checkpoint when save() returns
        self.store.wait()  # retention's background delete: not the trainer's wait, yet done
        # before the next round so that it does not slow that round's raw write
        assert self.store.failures == 0
        self.saves.append({k: v - start for k, v in self.phases.items()} | {"total": end - start})
        return end - start

    def best(self, phase: str = "total") -> float:
        return min(s[phase] for s in self.saves)

    def median(self) -> float:
        return statistics.median(s["total"] for s in self.saves)


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def sync_rounds(state: dict[str, Any], base: Path, repeats: int) -> tuple[float, float, float]:
    """Raw write, full sync save and sharded sync save, interleaved round by round so that all
    three see the same disk and CPU load; the per-round ratios are the figures least disturbed
    by the other work of a shared machine. Returns (raw, full save, sharded save) best seconds."""
    nbytes = state_nbytes(state)
    shard_state = named_optimizer(state)
    full = TimedStore(RunDir(base / "sync").create(), CheckpointConfig(keep_last=1))
    sharded_cfg = CheckpointConfig(keep_last=1, format="sharded")
    sharded = TimedStore(RunDir(base / "sharded-sync").create(), sharded_cfg)
    raws: list[float] = []
    ratios: dict[str, list[float]] = {"full": [], "sharded": []}
    for step in range(1, repeats + 1):
        times = {}
        runs: list[tuple[str, Callable[[], float]]] = [
            ("raw", lambda: raw_write(state, base / "raw.bin")),
            ("full", functools.partial(full.save, step, state)),
            ("sharded", functools.partial(sharded.save, step, shard_state)),
        ]
        for name, run in runs[step % 3 :] + runs[: step % 3]:  # each goes first in some rounds
            times[name] = run()
        raws.append(times["raw"])
        for name in ratios:
            ratios[name].append(times[name] / times["raw"])
    raw_s, full_s, sharded_s = min(raws), full.best(), sharded.best()
    files_s, manifest_s = full.best("files-written"), full.best("manifest-written")
    shards_s, published_s = sharded.best("shards-written"), sharded.best("manifest-written")

    def versus_raw(name: str, store: TimedStore) -> str:
        best, median = store.best(), store.median()
        return (
            f"{best:6.2f} s best ({nbytes / best / 1e6:5.0f} MB/s), {median:.2f} s median; "
            f"{best / raw_s:.2f}x the best raw write, per round median "
            f"{statistics.median(ratios[name]):.2f}x (target <= 1.2x)"
        )

    print(
        f"raw write+fsync  : {raw_s:6.2f} s best ({nbytes / raw_s / 1e6:5.0f} MB/s), "
        f"{statistics.median(raws):.2f} s median\n"
        f"sync save        : {versus_raw('full', full)}\n"
        f"  of which torch.save+sha256+fsync of the files: {files_s:6.2f} s; "
        f"manifest: {manifest_s - files_s:.2f} s; rename, fsync, retention's rename (it deletes "
        f"the previous checkpoint in the background): {full_s - manifest_s:.2f} s\n"
        f"sharded sync save: {versus_raw('sharded', sharded)}\n"
        f"  of which DCP write+sha256+fsync of the shards: {shards_s:6.2f} s; trainer_state.pt, "
        f"manifest: {published_s - shards_s:.2f} s; rename, fsync, retention's rename: "
        f"{sharded_s - published_s:.2f} s\n"
        f"  per round (raw s, full x, sharded x): "
        + ", ".join(
            f"({r:.2f}, {f:.2f}, {h:.2f})"
            for r, f, h in zip(raws, ratios["full"], ratios["sharded"], strict=True)
        )
    )
    return raw_s, full_s, sharded_s


WARM_UP_SAVES = 2


STEP_S = 0.1  # the stand-in training step between a save and the next optimizer step


def matmuls(count: int) -> None:
    a = torch.randn(256, 256)
    for _ in range(count):
        a = torch.tanh(a @ a)


def async_rounds(
    label: str, store: CheckpointStore, state: dict[str, Any], sync_s: float, repeats: int
) -> None:
    """The time the training loop is blocked by an async save, steady state, against the best
    sync save: the time in `save()` plus the wait for the copy to host memory at the next
    optimizer step (`wait_for_staging`). Twice: with the optimizer step right after `save()`
    (the worst case: the loop waits for the whole copy) and after a stand-in forward/backward
    of STEP_S (matmuls on the same cores). Then how much slower the stand-in training runs while
    the background write goes on."""
    baseline_rate = matmul_rate(1.0)
    step_matmuls = int(baseline_rate * STEP_S)
    blocked: dict[bool, list[float]] = {False: [], True: []}  # by "a step in between"
    in_save, published, slowdowns = [], [], []
    # The first saves allocate the host staging memory (first touch of fresh pages; for DCP also
    # until glibc's malloc raises its mmap threshold past the tensors' size): left out, the
    # steady state is what a long run sees at every save.
    for step in range(1, 2 * repeats + WARM_UP_SAVES + 1):
        between = step % 2 == 0
        start = settled()
        assert store.save(step, state)
        returned = time.perf_counter()
        if between:
            matmuls(step_matmuls)
        fence = time.perf_counter()
        store.wait_for_staging()
        stalled = returned - start + time.perf_counter() - fence
        stop, done = threading.Event(), [0]
        worker = threading.Thread(target=busy_loop, args=(stop, done))
        window = time.perf_counter()
        worker.start()
        while store.in_flight:
            time.sleep(0.01)  # polling the background save's state
        stop.set()
        worker.join()
        if step > WARM_UP_SAVES:
            blocked[between].append(stalled)
            in_save.append(returned - start)
            published.append(time.perf_counter() - start)
            slowdowns.append(1 - done[0] / (time.perf_counter() - window) / baseline_rate)
        store.wait()
        assert store.failures == 0

    def stall(between: bool) -> str:
        best, median = min(blocked[between]), statistics.median(blocked[between])
        return (
            f"{best:.3f} s best, {median:.3f} s median = {best / sync_s:.1%} / "
            f"{median / sync_s:.1%} of the best sync save"
        )

    print(
        f"{label}: training blocked (target <= 10%), optimizer step right after save(): "
        f"{stall(False)}; after a {STEP_S:.1f} s stand-in step: {stall(True)}\n"
        f"  save() itself returns in {statistics.median(in_save):.3f} s (median); "
        f"{min(published):.2f} s until published; stand-in training "
        f"{statistics.median(slowdowns):.0%} slower meanwhile (writer and trainer share the cores)"
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
        print(
            f"state: {state_nbytes(state) / 1e6:.0f} MB of tensors, written under {base}; {load()}"
        )
        _, save_s, sharded_s = sync_rounds(state, base, args.repeats)

        sync_run = RunDir(base / "sync")
        # Full checkpoints are memory-mapped: a load is timed with the copy of every tensor into
        # the process's own memory, as resuming does (trainer/mapped_state.py).
        start = time.perf_counter()
        loaded = mapped_state.copied(CheckpointStore(sync_run, CheckpointConfig(), 0, 1).load())
        load_s = time.perf_counter() - start
        assert loaded is not None
        start = time.perf_counter()
        mapped_state.copied(CheckpointStore(sync_run, CheckpointConfig(verify="full"), 0, 1).load())
        load_full_s = time.perf_counter() - start
        print(f"load (verify=size): {load_s:6.2f} s   load (verify=full): {load_full_s:6.2f} s")
        del loaded

        async_run = RunDir(base / "async").create()
        store = CheckpointStore(async_run, CheckpointConfig(keep_last=1, async_save=True), 0, 1)
        async_rounds("async save stall ", store, state, save_s, args.repeats)
        sharded_cfg = CheckpointConfig(keep_last=1, format="sharded", async_save=True)
        store = CheckpointStore(RunDir(base / "sharded-async").create(), sharded_cfg, 0, 1)
        async_rounds("sharded async    ", store, named_optimizer(state), sharded_s, args.repeats)
        print(load())
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Gradient all-reduce volume and data-parallel scaling of the real trainer (CPU, gloo).

Runs `torchrun -m trainer train` on this host and reads the run directories' metrics.jsonl:

1. 2 ranks with comm.compression none / bf16 / fp16: payload bytes per step and step time;
2. weak scaling: 2 ranks with per-rank batch b against 1 rank with batch b
   (efficiency = tokens/s of 2 ranks / (2 × tokens/s of 1 rank); target ≥ 90 %);
3. parallel.strategy ddp vs fsdp at 2 ranks: bytes per rank per step (DDP: all-reduce payload;
   FSDP: all-gather + reduce-scatter payload), step time, and rank 0's measured peak memory (RSS
   on CPU: it includes the ~0.3 GB torch runtime, so the ratio understates the sharding), next to
   the model + gradient + AdamW state each rank holds (16 B per parameter, / world under FSDP).

Each worker gets one intra-op thread, so 2 ranks need 2 free cores: on a shared or smaller
machine the efficiency measures the machine, not the trainer. Prints; asserts nothing.
Usage: python bench/comm.py [--steps N] [--preset small]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.data import prepare  # noqa: E402
from trainer.rundir import RunDir  # noqa: E402

SKIP_STEPS = 2  # warm-up steps left out of the medians


def run(nproc: int, data: Path, run_dir: Path, args: argparse.Namespace, *extra: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", "-m", "trainer", "train"]
    command += ["--config", str(REPO / "trainer/configs/tiny.yaml")]
    command += [
        f"model.preset={args.preset}",
        "model.mean_recurrence=2",
        f"data.path={data}",
        f"run_dir={run_dir}",
        f"train.steps={args.steps}",
        "train.precision=fp32",
        f"checkpoint.interval_steps={args.steps + 1}",
        "checkpoint.keep_last=1",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"torchrun failed ({result.returncode}):\n{result.stderr[-2000:]}")
    records = [r for r in RunDir(run_dir).read_metrics() if r["kind"] == "train"][SKIP_STEPS:]
    return {
        "comm_bytes": statistics.median(r["comm_bytes"] for r in records),
        "step_time": statistics.median(r["step_time"] for r in records),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
        "peak_memory": max(r["peak_memory_bytes"] for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch b (samples)")
    args = parser.parse_args()
    b = args.batch
    with tempfile.TemporaryDirectory(prefix="bench-comm-") as tmp:
        data = Path(tmp) / "data"
        prepare(data, seq_len=64, vocab_size=4096)
        print(f"preset {args.preset}, depth ~3, 64 tokens/sample, {args.steps} steps, gloo")
        print(f"{'ranks':>5} {'compression':>11} {'bytes/step':>12} {'step time':>10} {'tok/s':>8}")
        results = {}
        for compression in ("none", "bf16", "fp16"):
            results[compression] = run(
                2,
                data,
                Path(tmp) / f"run-{compression}",
                args,
                f"comm.compression={compression}",
                f"train.global_batch={2 * b}",
                f"train.micro_batch={b}",
            )
            r = results[compression]
            print(
                f"{2:>5} {compression:>11} {r['comm_bytes']:>12,.0f} "
                f"{1000 * r['step_time']:>8.0f}ms {r['tokens_per_s']:>8,.0f}"
            )
        single = run(
            1,
            data,
            Path(tmp) / "run-single",
            args,
            f"train.global_batch={b}",
            f"train.micro_batch={b}",
        )
        print(
            f"{1:>5} {'-':>11} {0:>12} {1000 * single['step_time']:>8.0f}ms "
            f"{single['tokens_per_s']:>8,.0f}"
        )
        ratio = results["bf16"]["comm_bytes"] / results["none"]["comm_bytes"]
        efficiency = results["none"]["tokens_per_s"] / (2 * single["tokens_per_s"])
        print(f"bf16 bytes / none bytes: {ratio:.3f}")
        print(
            f"weak scaling, per-rank batch {b}: 2 ranks {results['none']['tokens_per_s']:,.0f} "
            f"tok/s vs 2 x {single['tokens_per_s']:,.0f} tok/s -> efficiency {100 * efficiency:.0f}% "
            f"(target >= 90%; {os.cpu_count()} CPU cores on this host)"
        )
        strategies(data, Path(tmp), args)


def strategies(data: Path, tmp: Path, args: argparse.Namespace) -> None:
    import torch

    from trainer.config import load_config
    from trainer.model import RecurrentLM

    cfg = load_config(REPO / "trainer/configs/tiny.yaml", [f"model.preset={args.preset}"])
    with torch.device("meta"):
        n_params = RecurrentLM(cfg.model).param_counts().total
    b = args.batch
    print(
        f"\n{'strategy':>8} {'bytes/step/rank':>16} {'step time':>10} {'peak RSS':>9} "
        f"{'state/rank':>11}"
    )
    for strategy in ("ddp", "fsdp"):
        r = run(
            2,
            data,
            tmp / f"run-{strategy}",
            args,
            f"parallel.strategy={strategy}",
            f"train.global_batch={4 * b}",
            f"train.micro_batch={b}",
        )
        state = 16 * n_params / (2 if strategy == "fsdp" else 1)
        print(
            f"{strategy:>8} {r['comm_bytes']:>16,.0f} {1000 * r['step_time']:>8.0f}ms "
            f"{r['peak_memory'] / 2**20:>7.0f}Mi {state / 2**20:>9.1f}Mi"
        )
    print(f"({n_params:,} parameters; 2 micro-batches per rank per step, fp32)")


if __name__ == "__main__":
    main()

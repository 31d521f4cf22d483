"""GPU figures in one prepared run of a few minutes (prints; asserts nothing).

1. `1b` preset, bf16, parallel.strategy=fsdp at world size 1 (torchrun, one process), compiled
   blocks: tokens/s, MFU by the project's own accounting (trainer/flops.py), peak memory;
   target MFU >= 45 %.
2. `huginn-3.5b`, one training step at seq 4096 with activation checkpointing, bf16, fsdp:
   step time, MFU, peak memory; target: it fits.
3. CPU offload (`parallel.offload=true`, FSDP2's CPUOffloadPolicy): the `1b` run of 1 again for a
   few steps with parameters and AdamW state in host memory: tokens/s and peak device memory next
   to run 1's (offload cannot run without a GPU: this is its only test).
4. FSDP vs DDP device memory per rank at 2 ranks (`small` widened to ~24 M parameters, as in
   tests/trainer/test_parallel.py): peak device memory of rank 0, FSDP should be about half;
   needs 2 GPUs (skipped with one: NCCL refuses two ranks on one device).

Both run the real trainer (`torchrun -m trainer train`) on data prepared from the embedded corpus
(the sampler wraps epochs, so a small corpus still fills any batch) and read rank 0's
metrics.jsonl. The mean recurrence is lowered to keep the run short; MFU counts only the
iterations actually executed, so it stays comparable.

    python bench/gpu.py [--steps 12] [--depth 8] [--out DIR]

Not run on this project's CI (no GPU); say so when quoting figures. About 6-8 minutes on one
H100/H200-class GPU (the runs have their own timeouts).
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

WARMUP_STEPS = 3  # compilation and allocator warm-up, left out of the medians


def train(run_dir: Path, data: Path, *overrides: str, timeout: float, nproc: int = 1) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", "-m", "trainer", "train"]
    command += ["--config", str(REPO / "trainer/configs/tiny.yaml")]
    command += [f"data.path={data}", f"run_dir={run_dir}", "eval.every=0", "metrics.log_every=1"]
    command += ["train.precision=bf16", "train.device=cuda", "parallel.strategy=fsdp"]
    command += ["checkpoint.interval_steps=100000", *overrides]
    result = subprocess.run(
        command, cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        print(f"FAILED ({result.returncode}): {' '.join(overrides)}\n{result.stderr[-3000:]}")
        return []
    return [r for r in RunDir(run_dir).read_metrics() if r["kind"] == "train"]


def summary(name: str, records: list[dict], skip: int) -> None:
    if not records:
        print(f"{name}: no figures (the run failed, see above)")
        return
    steady = records[skip:] or records[-1:]
    tok_s = statistics.median(r["tokens_per_s"] for r in steady)
    mfu = statistics.median(r["mfu"] for r in steady)
    step = statistics.median(r["step_time"] for r in steady)
    peak = max(r["peak_memory_bytes"] for r in records)
    depth = statistics.mean(r["recurrence"] for r in steady)
    print(
        f"{name}: {tok_s:,.0f} tok/s, step {step:.2f} s, MFU {100 * mfu:.1f} %, "
        f"peak memory {peak / 2**30:.1f} GiB, mean depth {depth:.1f} "
        f"({len(steady)} steps measured)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps of the 1b run")
    parser.add_argument("--depth", type=int, default=8, help="model.mean_recurrence")
    parser.add_argument("--micro-batch", type=int, default=4, help="1b: samples per micro-batch")
    parser.add_argument("--out", type=Path, default=None, help="keep run directories here")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a GPU (torch.cuda.is_available() is False)")
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    base = Path(tempfile.mkdtemp(prefix="rlm-gpu-bench-", dir=args.out))
    data = base / "data-4096"
    prepare(data, seq_len=4096, vocab_size=4096)

    records = train(
        base / "1b",
        data,
        "model.preset=1b",
        "model.compile=true",
        f"model.mean_recurrence={args.depth}",
        f"train.steps={args.steps}",
        f"train.global_batch={args.micro_batch}",
        f"train.micro_batch={args.micro_batch}",
        timeout=900,
    )
    summary("1b, bf16, fsdp world 1, compiled, seq 4096", records, WARMUP_STEPS)

    records = train(
        base / "huginn-3.5b",
        data,
        "model.preset=huginn-3.5b",
        "model.activation_checkpointing=true",
        f"model.mean_recurrence={args.depth}",
        "train.steps=2",
        "train.global_batch=1",
        "train.micro_batch=1",
        timeout=900,
    )
    summary("huginn-3.5b, bf16, fsdp world 1, activation checkpointing, seq 4096", records, 1)

    records = train(
        base / "1b-offload",
        data,
        "model.preset=1b",
        "model.compile=true",
        "parallel.offload=true",
        f"model.mean_recurrence={args.depth}",
        "train.steps=5",
        f"train.global_batch={args.micro_batch}",
        f"train.micro_batch={args.micro_batch}",
        timeout=600,
    )
    summary("1b, bf16, fsdp world 1, CPU offload, seq 4096", records, 2)

    if torch.cuda.device_count() < 2:
        print("ddp vs fsdp memory at 2 ranks: skipped (needs 2 GPUs)")
    else:
        memory_model = ["model.preset=small", "model.d_model=512", "model.mlp_hidden=1408"]
        short = base / "data-64"  # the small preset's sequences (max_seq_len 256)
        prepare(short, seq_len=64, vocab_size=4096)
        for strategy in ("ddp", "fsdp"):
            records = train(
                base / f"memory-{strategy}",
                short,
                *memory_model,
                f"parallel.strategy={strategy}",
                "train.precision=fp32",
                "train.steps=4",
                "train.global_batch=2",
                "train.micro_batch=1",
                timeout=300,
                nproc=2,
            )
            summary(f"{strategy} 2 ranks, ~24 M parameters, fp32 (rank 0)", records, 1)
    print(f"run directories under {base}")


if __name__ == "__main__":
    main()

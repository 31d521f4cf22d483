"""Peak host memory of each rank while it resumes, full and sharded checkpoints (prints figures).

A model of at least 500 MB (the `small` preset widened: d 1280, SwiGLU 3584, ~130 M parameters,
522 MB of fp32 weights; with AdamW's two moments a checkpoint of ~1.6 GB) is trained one step on
N gloo ranks (default 4, fsdp) and saved in each format; a second run resumes from it. Each rank
records (trainer test hooks, this module's `ResumeMemory`) its resident size just before the
model is built, and at its first step after the resume its peak resident size so far
(`ru_maxrss`) and its resident size now. Printed per rank: the peak above the pre-model size
against the target, 1.5 x the rank's own state (weights + AdamW moments of its shards) plus the
model's largest tensor.

    python bench/resume_memory.py [--ranks 4] [--strategy fsdp] [--d-model 1280] [--out DIR]

glibc keeps freed blocks of up to 32 MiB in its arenas (RSS would count memory the process no
longer uses): the runs set MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ as
tests/trainer/test_parallel.py does. Needs ~3 GB of free memory per rank with 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.distributed import DistEnv  # noqa: E402
from trainer.hooks import HOOKS_ENV, TrainHooks  # noqa: E402

FOLLOW_LIVE_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class ResumeMemory(TrainHooks):
    """Writes run_dir/resume-memory-rank<r>.json at the first step of the run."""

    def before_startup_check(self, env: DistEnv) -> None:
        self.before_model = resident_bytes()  # the model is built (and resumed) after this

    def on_batch(
        self, run_dir: Path, rank: int, step: int, positions: list[int], indices: list[int]
    ) -> None:
        if hasattr(self, "written"):
            return
        self.written = True
        record = {
            "step": step,
            "before_model": self.before_model,
            "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
            "now": resident_bytes(),
        }
        (run_dir / f"resume-memory-rank{rank}.json").write_text(json.dumps(record))


def torchrun(ranks: int, run_dir: Path, data: Path, *overrides: str, hooks: bool) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={ranks}", "-m", "trainer", "train"]
    command += ["--config", str(REPO / "trainer/configs/tiny.yaml")]
    command += [f"data.path={data}", f"run_dir={run_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", **FOLLOW_LIVE_MEMORY)
    if hooks:
        env[HOOKS_ENV] = f"{__name__.replace('__main__', 'bench.resume_memory')}:ResumeMemory"
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"run failed ({result.returncode}):\n{result.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--strategy", default="fsdp", choices=("ddp", "fsdp", "hsdp"))
    parser.add_argument("--d-model", type=int, default=1280)
    parser.add_argument("--formats", default="full,sharded")
    parser.add_argument("--out", type=Path, default=None, help="keep run directories here")
    args = parser.parse_args()

    import torch

    from trainer.data import prepare
    from trainer.model import RecurrentLM, model_config

    d = args.d_model
    shape = {"d_model": d, "n_heads": d // 128, "mlp_hidden": d * 14 // 5, "max_seq_len": 64}
    shape |= {"mean_recurrence": 1, "backprop_depth": 1}
    with torch.device("meta"):
        model = RecurrentLM(model_config("small", **shape))
    params = model.param_counts().total
    largest = max(p.numel() * 4 for p in model.parameters())
    shards = 1 if args.strategy == "ddp" else args.ranks
    own = 12 * params / shards  # fp32 weights + AdamW's two fp32 moments, this rank's part
    base = Path(tempfile.mkdtemp(prefix="rlm-resume-memory-", dir=args.out))
    data = base / "data"
    prepare(data, seq_len=64, vocab_size=4096)
    model_args = ["model.preset=small", *(f"model.{k}={v}" for k, v in shape.items())]
    run_args = [*model_args, f"parallel.strategy={args.strategy}", "train.precision=fp32"]
    run_args += [f"train.global_batch={args.ranks}", "train.micro_batch=1", "eval.every=0"]
    run_args += ["checkpoint.interval_steps=1", "checkpoint.keep_last=1"]
    mib = 2**20
    print(
        f"model: {params / 1e6:.1f} M parameters, {params * 4 / 1e6:.0f} MB fp32, "
        f"checkpoint ~{params * 12 / 1e6:.0f} MB with AdamW; largest tensor {largest / mib:.1f} "
        f"MiB; {args.ranks} ranks, {args.strategy}: own state {own / mib:.0f} MiB per rank; "
        f"target peak <= 1.5 x own + largest = {(1.5 * own + largest) / mib:.0f} MiB"
    )
    for fmt in args.formats.split(","):
        run_dir = base / fmt
        common = [*run_args, f"checkpoint.format={fmt}"]
        torchrun(args.ranks, run_dir, data, *common, "train.steps=1", hooks=False)
        torchrun(args.ranks, run_dir, data, *common, "train.steps=2", hooks=True)
        print(f"{fmt} checkpoint, resume: MiB above the resident size before the model was built")
        print("  rank  peak  now  peak/(own+largest)  target met")
        for rank in range(args.ranks):
            record = json.loads((run_dir / f"resume-memory-rank{rank}.json").read_text())
            peak = record["peak"] - record["before_model"]
            now = record["now"] - record["before_model"]
            ratio = peak / (own + largest)
            met = "yes" if peak <= 1.5 * own + largest else "NO"
            print(f"  {rank:>4}  {peak / mib:>4.0f}  {now / mib:>4.0f}  {ratio:>18.2f}  {met}")
    print(f"run directories under {base}")


if __name__ == "__main__":
    main()

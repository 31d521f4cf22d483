"""The production matrix, run by tests/trainer/test_production_matrix.py: every cell is a real
training through `trainer.train.train` on the ranks of one torchrun job (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m tests.trainer.production_matrix DATA OUT

The job forms its process group once and trains the cells one after the other in it (the trainer
joins a group its caller formed and leaves it up): starting torchrun and gloo once instead of per
cell is most of what keeps the matrix within its time budget. Each cell trains steps 1-3 (saving
at 2 and 3), then a second `train()` resumes from step 2 and trains steps 3-4, as an operator's
restart would. Rank 0 writes OUT/results.json after every cell, so a cell that crashes the job
leaves the verdicts of the cells before it.

Cells (pairwise coverage): precision {fp32, bf16, fp16} x strategy {ddp, fsdp, hsdp} x activation
checkpointing x compile x checkpoint format x save; fp16 exists with ddp only (config.validate
refuses fp16 with fsdp/hsdp in one line), which leaves 7 precision x strategy pairs; the smallest
set found that covers every pair of values of every two factors, with the flagship cell (bf16,
fsdp, activation checkpointing, compiled, sharded async checkpoints) among them, has 8 cells, 3 of
them compiled (a compiled cell costs ~40 s of compiling on 2 cores; the others a few seconds).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# A lean step: 8 samples of 64 tokens per step as 2 ranks x 2 micro-batches of 2 (gradient
# accumulation), depth ~2; constant learning rate after 2 warmup steps, so that stopping at step
# 3 and resuming to 4 follows the same schedule as an uninterrupted run.
COMMON = ["model.mean_recurrence=2", "train.global_batch=8", "train.micro_batch=2"]
COMMON += ["eval.every=0", "metrics.log_every=1", "optim.warmup_steps=2", "optim.min_lr_ratio=1.0"]
COMMON += ["checkpoint.interval_steps=2", "checkpoint.keep_last=0"]


@dataclass(frozen=True)
class Cell:
    precision: str
    strategy: str
    checkpointing: bool  # model.activation_checkpointing
    compiled: bool  # model.compile
    format: str  # checkpoint.format
    async_save: bool
    replicas: int = 0  # hsdp replica groups (0: one per node, here 1 group of 2 shards)

    @property
    def name(self) -> str:
        parts = [self.precision, self.strategy + (f"x{self.replicas}" if self.replicas else "")]
        parts += ["ac" if self.checkpointing else "noac", "compiled" if self.compiled else "eager"]
        parts += [self.format, "async" if self.async_save else "sync"]
        return "-".join(parts)

    def overrides(self) -> list[str]:
        return [
            *COMMON,
            f"train.precision={self.precision}",
            f"parallel.strategy={self.strategy}",
            f"parallel.replicas={self.replicas}",
            f"model.activation_checkpointing={str(self.checkpointing).lower()}",
            f"model.compile={str(self.compiled).lower()}",
            f"checkpoint.format={self.format}",
            f"checkpoint.async_save={str(self.async_save).lower()}",
        ]


# The uninterrupted fp32/DDP run every cell is compared with.
REFERENCE = Cell("fp32", "ddp", False, False, "full", False)
# fmt: off
CELLS = (
    Cell("bf16", "fsdp", True,  True,  "sharded", True),   # the flagship configuration
    Cell("bf16", "ddp",  True,  False, "full",    False),
    Cell("bf16", "hsdp", False, False, "sharded", True, replicas=2),  # 2 replicas x 1 shard
    Cell("fp16", "ddp",  True,  False, "full",    True),
    Cell("fp16", "ddp",  False, True,  "sharded", False),
    Cell("fp32", "ddp",  True,  False, "sharded", True),
    Cell("fp32", "fsdp", False, False, "full",    False),
    Cell("fp32", "hsdp", True,  True,  "full",    False),  # 1 replica x 2 shards
)
# fmt: on


def main(data: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from tests.trainer.training_runs import tiny_config
    from trainer.train import train

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    # A compiled cell must really run compiled: past the recompile limit dynamo would fall back
    # to eager without a word.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    rank = dist.get_rank()
    results: dict[str, dict] = {}
    plan = [("reference", REFERENCE, (["train.steps=4"],))]
    resume = (["train.steps=3"], ["train.steps=4", "checkpoint.resume=step-00000002"])
    plan += [(cell.name, cell, resume) for cell in CELLS]
    for name, cell, runs in plan:
        started = time.perf_counter()
        codes = []
        try:
            for extra in runs:
                cfg = tiny_config(data, out / name, *cell.overrides(), *extra)
                codes.append(int(train(cfg)))
            verdict = {"exit_codes": codes}
        except BaseException as exc:  # the group may be out of step now: record and stop
            verdict = {"exit_codes": codes, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        verdict |= {"cell": asdict(cell), "seconds": time.perf_counter() - started}
        results[name] = verdict
        if rank == 0:
            (out / "results.json").write_text(json.dumps(results, indent=1))
        if "error" in verdict:
            sys.exit(1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

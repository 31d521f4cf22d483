"""Training throughput: the reference config's share of the GEMM ceiling, and the `small`
recurrent model next to an equal-FLOP plain transformer.

Runs on this CPU, prints figures, asserts nothing.

    .venv/bin/python bench/trainer_throughput.py reference [--compile] [--steps N]
    .venv/bin/python bench/trainer_throughput.py reference --interleave ROUNDS [--baseline MODEL_PY]
    .venv/bin/python bench/trainer_throughput.py [small] [--threads N] [--steps N] [--batch B]

`reference` is the config a reference implementation is commonly measured at: d=256, 4 heads,
SwiGLU 704, prelude/core/coda 1/2/1, vocab 8192, seq 256, batch 8, a fixed 2 no-grad + 2 grad
core iterations, AdamW, 2 threads. It prints the achieved model FLOP/s (trainer.flops) as a share
of the GEMM ceiling measured in the same process (torch.mm 2048³), for fp32 and bf16 autocast,
from the best of N steps (other processes only ever slow a step down), in wall and CPU time.
Targets (reported, not asserted): ≥ 58 % fp32, ≥ 22 % bf16. With `--interleave ROUNDS` it
measures the ceiling and one step right after it ROUNDS times and reports the best and median
shares; `--baseline MODEL_PY` (e.g. from `git show REV:trainer/model.py`) runs another model.py
interleaved with this tree's, for before/after comparisons on a loaded machine.

`small`:

For each dtype (fp32, and bf16 through CPU autocast) it times full training steps (forward,
backward, AdamW step) at fixed depth r = mean_recurrence, so every step does the same work.
The two models' steps are interleaved, so load from other processes on a shared host hits both
alike; the median step time is reported. MFU-style figures divide the achieved model FLOP/s
(trainer.flops convention) by the GEMM ceiling this CPU reaches in that dtype with the same
thread count (trainer.flops.measure_gemm_flops, best of repeated 1024³ matmuls).

Two clocks: wall time (what a user waits for) and process CPU time, for both the steps and the
GEMM ceiling. On a busy shared host the wall figures mostly measure the other processes; with one
thread (the default while the load average is at least the core count) the CPU-time ratio is the
model's own efficiency. (With more threads, CPU time also counts OpenMP threads spinning at
barriers, so that ratio is a lower bound.)

Targets (reported, not asserted): ≥ 55 % of the GEMM ceiling; the recurrent model's achieved
FLOP/s within 10 % of the plain transformer's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import OptimConfig
from trainer.flops import flops_per_token, measure_gemm_flops
from trainer.model import PRESETS, Block, ModelConfig, RecurrentLM, RMSNorm, rope_cache
from trainer.optim import build_optimizer


class PlainLM(nn.Module):
    """A standard transformer built from the same blocks: embedding, L blocks, norm, tied head."""

    rope_cos: torch.Tensor  # buffers (register_buffer)
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, n_layers: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        cos, sin = rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, False)
        self.register_buffer("rope_sin", sin, False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embedding(input_ids) * math.sqrt(self.cfg.d_model)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = F.linear(self.final_norm(x), self.embedding.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def plain_flops_per_token(cfg: ModelConfig, n_layers: int, seq_len: int) -> float:
    """Same convention as trainer.flops: 6·(weights incl. tied head) + 12·L·d·T."""
    with torch.device("meta"):
        block = sum(p.numel() for p in Block(cfg).parameters())
    weights = n_layers * block + cfg.d_model + cfg.vocab_size * cfg.d_model
    return 6 * weights + 12 * n_layers * cfg.d_model * seq_len


def matching_plain_depth(cfg: ModelConfig, num_steps: int, seq_len: int) -> int:
    """The plain layer count whose FLOPs per token come closest to the recurrent model's."""
    target = flops_per_token(cfg, num_steps, cfg.backprop_depth, seq_len).useful
    executed = cfg.n_prelude + cfg.n_coda + cfg.n_core * num_steps
    return min(
        range(1, 2 * executed),
        key=lambda n: abs(plain_flops_per_token(cfg, n, seq_len) - target),
    )


def make_step(
    model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], dtype: torch.dtype
) -> Callable[[], tuple[float, float]]:
    """A closure running one training step and returning its (wall, CPU) seconds; the optimizer
    is the trainer's (AdamW, fused kernel)."""
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4), torch.device("cpu"))

    def step() -> tuple[float, float]:
        autocast = (
            torch.autocast("cpu", dtype=dtype)
            if dtype != torch.float32
            else contextlib.nullcontext()
        )
        wall, cpu = time.perf_counter(), time.process_time()
        with autocast:
            loss = loss_fn(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - wall, time.process_time() - cpu

    return step


REFERENCE = ModelConfig(
    vocab_size=8192, d_model=256, n_heads=4, mlp_hidden=704, n_prelude=1, n_core=2, n_coda=1,
    max_seq_len=256, mean_recurrence=4, backprop_depth=2,
)  # fmt: skip
REFERENCE_TARGETS = {torch.float32: 0.58, torch.bfloat16: 0.22}


def reference(steps: int, compile_blocks: bool) -> None:
    """The reference config at r = 4 (2 no-grad + 2 grad iterations), batch 8 × 256, 2 threads."""
    torch.set_num_threads(2)
    cfg = replace(REFERENCE, compile=compile_blocks)
    batch, seq_len = 8, cfg.max_seq_len
    tokens = batch * seq_len
    work = flops_per_token(cfg, cfg.mean_recurrence, cfg.backprop_depth, seq_len).useful * tokens
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1))
    inputs, labels, seeds = ids[:, :-1], ids[:, 1:], list(range(batch))
    print(
        f"reference config: torch {torch.__version__}, 2 threads, load average "
        f"{os.getloadavg()[0]:.1f}, compile={compile_blocks}; {work / tokens / 1e6:.1f} "
        f"MFLOP/token, best of {steps} steps after warm-up"
    )
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16 autocast")):
        torch.manual_seed(0)
        model = RecurrentLM(cfg)
        step = make_step(model, lambda m: m(inputs, labels, state_seeds=seeds).loss, dtype)
        started = time.perf_counter()
        step()  # warm-up (and compilation)
        warm_up = time.perf_counter() - started
        step()
        runs = [step() for _ in range(steps)]
        wall, cpu = min(w for w, _ in runs), min(c for _, c in runs)
        ceiling_wall = measure_gemm_flops(dtype, size=2048, seconds=2.0)
        ceiling_cpu = measure_gemm_flops(dtype, size=2048, seconds=2.0, clock=time.process_time)
        share = work / wall / ceiling_wall
        print(
            f"  {label:<13} step {wall:.3f} s ({tokens / wall:,.0f} tok/s, first step "
            f"{warm_up:.1f} s): {work / wall / 1e9:.1f} GFLOP/s = {share:.1%} of the "
            f"{ceiling_wall / 1e9:.0f} GFLOP/s mm ceiling; CPU time {cpu:.3f} s = "
            f"{work / cpu / ceiling_cpu:.1%} of {ceiling_cpu / 1e9:.0f} GFLOP/CPU-s; target "
            f"≥ {REFERENCE_TARGETS[dtype]:.0%}: {'met' if share >= REFERENCE_TARGETS[dtype] else 'NOT met'}"
        )


def load_model_class(path: str) -> type[nn.Module]:
    """RecurrentLM from another copy of trainer/model.py (e.g. `git show REV:trainer/model.py`),
    built from that file's own ModelConfig."""
    spec = importlib.util.spec_from_file_location("baseline_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)

    def build(cfg: ModelConfig) -> nn.Module:
        return module.RecurrentLM(module.ModelConfig(**asdict(cfg)))

    return build  # type: ignore[return-value]


def reference_interleaved(rounds: int, baseline: str | None) -> None:
    """The reference config, each round measuring the GEMM ceiling and then one step of each
    model right after it, so load from other processes hits ceiling and steps alike; the best
    and the median of the per-round shares are reported (and `baseline`, another model.py,
    runs interleaved with this tree's)."""
    torch.set_num_threads(2)
    cfg, batch = REFERENCE, 8
    tokens = batch * cfg.max_seq_len
    work = flops_per_token(cfg, cfg.mean_recurrence, cfg.backprop_depth, cfg.max_seq_len).useful
    work *= tokens
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len + 1))
    inputs, labels, seeds = ids[:, :-1], ids[:, 1:], list(range(batch))
    builders: dict[str, Callable[[ModelConfig], nn.Module]] = {"this tree": RecurrentLM}
    if baseline:
        builders["baseline"] = load_model_class(baseline)
    print(
        f"reference config, interleaved: torch {torch.__version__}, 2 threads, load average "
        f"{os.getloadavg()[0]:.1f}; {rounds} rounds of (mm 2048³ ceiling, one step per model)"
    )
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16 autocast")):
        steps = {}
        for name, build in builders.items():
            torch.manual_seed(0)
            model = build(cfg)
            steps[name] = make_step(
                model, lambda m: m(inputs, labels, state_seeds=seeds).loss, dtype
            )
            steps[name]()  # warm-up
            steps[name]()
        shares: dict[str, list[float]] = {name: [] for name in steps}
        walls: dict[str, list[float]] = {name: [] for name in steps}
        ceilings = []
        for _ in range(rounds):
            ceiling = measure_gemm_flops(dtype, size=2048, seconds=1.0)
            ceilings.append(ceiling)
            for name, step in steps.items():
                wall, _ = step()
                walls[name].append(wall)
                shares[name].append(work / wall / ceiling)
        print(
            f"  {label} (target ≥ {REFERENCE_TARGETS[dtype]:.0%} of the ceiling), ceiling best "
            f"{max(ceilings) / 1e9:.0f}, median {statistics.median(ceilings) / 1e9:.0f} GFLOP/s:"
        )
        for name in steps:
            best, median = max(shares[name]), statistics.median(shares[name])
            print(
                f"    {name:<10} share of ceiling best {best:.1%}, median {median:.1%}; step best "
                f"{min(walls[name]):.3f} s, median {statistics.median(walls[name]):.3f} s; best "
                f"step / best ceiling {work / min(walls[name]) / max(ceilings):.1%}"
            )


def main() -> None:
    if sys.argv[1:2] == ["reference"]:
        parser = argparse.ArgumentParser(description="the reference config")
        parser.add_argument("--steps", type=int, default=6, help="timed steps per dtype")
        parser.add_argument("--compile", action="store_true", help="model.compile=true")
        parser.add_argument(
            "--interleave", type=int, metavar="ROUNDS", help="ceiling and step interleaved"
        )
        parser.add_argument(
            "--baseline", metavar="MODEL_PY", help="with --interleave: another model.py too"
        )
        args = parser.parse_args(sys.argv[2:])
        if args.interleave:
            reference_interleaved(args.interleave, args.baseline)
        else:
            reference(args.steps, args.compile)
        return
    if sys.argv[1:2] == ["small"]:
        del sys.argv[1]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = len(os.sched_getaffinity(0))
    # On a host already busier than its cores, OpenMP threads keep waiting at barriers for a
    # descheduled sibling (measured here: elementwise ops 8× slower with 2 threads than with 1).
    busy = os.getloadavg()[0] >= cores
    parser.add_argument(
        "--threads",
        type=int,
        default=1 if busy else cores,
        help=f"intra-op threads; default: all {cores} cores, or 1 while the load average ≥ {cores}",
    )
    parser.add_argument("--steps", type=int, default=4, help="timed steps per model and dtype")
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    cfg = PRESETS["small"]
    seq_len, r = cfg.max_seq_len, cfg.mean_recurrence
    tokens = args.batch * seq_len
    recurrent_flops = flops_per_token(cfg, r, cfg.backprop_depth, seq_len).useful
    plain_layers = matching_plain_depth(cfg, r, seq_len)
    plain_flops = plain_flops_per_token(cfg, plain_layers, seq_len)
    plain_name = f"plain L={plain_layers}"

    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, seq_len + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    seeds = list(range(args.batch))

    print(
        f"torch {torch.__version__}, torch.set_num_threads({args.threads}) of {cores} cores, "
        f"load average {os.getloadavg()[0]:.1f}{' (busy host)' if busy else ''}; batch {args.batch}×{seq_len} = {tokens} "
        f"tokens/step; median of {args.steps} timed steps after 2 warm-up steps"
    )
    print(
        f"recurrent: preset small, prelude/core/coda {cfg.n_prelude}/{cfg.n_core}/{cfg.n_coda}, "
        f"r={r}, k={cfg.backprop_depth}: {recurrent_flops / 1e6:.1f} MFLOP/token; "
        f"{plain_name} (same blocks, no recurrence): {plain_flops / 1e6:.1f} MFLOP/token"
    )

    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16 autocast")):
        torch.manual_seed(0)
        recurrent = RecurrentLM(cfg)
        plain = PlainLM(cfg, plain_layers)
        steps = {
            "recurrent": make_step(
                recurrent,
                lambda m: m(inputs, labels, num_steps=r, state_seeds=seeds).loss,
                dtype,
            ),
            plain_name: make_step(plain, lambda m: m(inputs, labels), dtype),
        }
        flops = {"recurrent": recurrent_flops, plain_name: plain_flops}
        for step in steps.values():  # warm-up: allocator, oneDNN kernel selection
            step()
            step()
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
        for _ in range(args.steps):
            for name, step in steps.items():
                samples[name].append(step())
        ceiling_wall = measure_gemm_flops(dtype, seconds=1.0)
        ceiling_cpu = measure_gemm_flops(dtype, seconds=1.0, clock=time.process_time)

        print(
            f"\n{label}: GEMM ceiling {ceiling_wall / 1e9:.0f} GFLOP/s wall, "
            f"{ceiling_cpu / 1e9:.0f} GFLOP/CPU-s"
        )
        print(
            f"  {'model':<12} {'step s':>7} {'tok/s':>7} {'GFLOP/s':>8} {'of ceil':>8}"
            f" {'CPU s':>7} {'GFLOP/CPU-s':>12} {'of ceil':>8}"
        )
        ratios = {}
        for name, runs in samples.items():
            wall = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            work = flops[name] * tokens
            ratios[name] = (work / wall / ceiling_wall, work / cpu / ceiling_cpu)
            print(
                f"  {name:<12} {wall:>7.3f} {tokens / wall:>7.0f} {work / wall / 1e9:>8.1f}"
                f" {ratios[name][0]:>8.1%} {cpu:>7.3f} {work / cpu / 1e9:>12.1f}"
                f" {ratios[name][1]:>8.1%}"
            )
        best = max(ratios["recurrent"])
        versus = [a / b for a, b in zip(ratios["recurrent"], ratios[plain_name], strict=True)]
        print(
            f"  target ≥ 55 % of ceiling: {'met' if best >= 0.55 else 'NOT met'} ({best:.1%}); "
            f"recurrent FLOP/s vs plain (wall, CPU): {versus[0]:.1%}, {versus[1]:.1%}: "
            f"{'met' if max(versus) >= 0.9 else 'NOT met'} (target ≥ 90 %)"
        )


if __name__ == "__main__":
    main()

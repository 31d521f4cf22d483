"""GPU figures from one booked GPU slot, and a CPU rehearsal of exactly the same runs.

Runs (each the real trainer, `torchrun -m trainer train`, on data prepared from the embedded
corpus; the sampler wraps epochs, so a small corpus fills any batch):

1. `1b-mfu`: the `1b` preset, bf16, fsdp, compiled blocks, micro-batch 2 without activation
   checkpointing (the plan's estimate: 62 of 125 usable GiB on an H200; 4 sequences would be
   108 GiB), sharded async checkpoints: tokens/s and MFU. Target MFU >= 45 % on an H200 (the
   reference run reached ~26 %, torchtitan 33-39 %).
2. `3.5b-step`: `huginn-3.5b` at seq 4096, bf16, compiled, activation checkpointing, in the
   layout `rlmctl plan` picks for this machine's GPUs: step time, MFU, peak memory.
3. `3.5b-async-save`: the same, saving a sharded async checkpoint every step: save time (the
   background write) and how long the loop waits for it.
4. `1b-offload`: run 1 with `parallel.offload=true` (FSDP2's CPUOffloadPolicy; it cannot run
   without a GPU, so this is its only test).

Every run first checks the plan's memory estimate (rlmctl/plan.py, the one `rlmctl plan` and
`rlmctl launch` use) against this GPU's memory and is skipped with the figures when it cannot
fit. Runs are independent processes with their own timeouts: one that fails or hangs is
recorded as such and the next one runs. Figures go to OUT/gpu-bench.json after every run
(written whole, atomically), so a bench killed half-way keeps what it measured.

MFU follows trainer/flops.py (PaLM's convention, as nanoGPT and torchtitan): useful FLOPs per
token = 6 x the weights a token passes through with gradient + 2 x those without (the core
iterations outside the backprop window) + attention 12·L·H·Q·T with gradient (4·... without),
recompute from activation checkpointing excluded; divided by the datasheet bf16 dense peak
(H100/H200 SXM 989 TFLOP/s, MI250X GCD 191.5, MI300X 1307; clusterspec/vendors).

The same script records the real tools' output for the test fixtures into OUT/fixtures/, each
file saying where, when and how it was recorded: `nvidia-smi -q -x`, `nvidia-smi topo -m`, and
the NCCL_DEBUG=INFO log of an all-reduce (`python -m trainer.allreduce` under torchrun).

    python bench/gpu.py [--steps 12] [--depth 8] [--out DIR] [--override RUN:key=value ...]
    python bench/gpu.py --rehearse --out DIR     # on CPU, tiny width: what the suite runs

`--rehearse` runs each run's exact code path (strategy, precision, compile, activation
checkpointing, checkpoint format, async save, world size, the plan check for an H200) on CPU at
the `tiny` width with 2 steps, so that a booked GPU slot is not spent finding a crash;
tests/trainer/test_gpu_bench.py runs it. About 10 minutes on one H100/H200-class GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from clusterspec.transport import DEBUG_ENV  # noqa: E402
from rlmctl import plan  # noqa: E402
from trainer.data import METADATA_NAME, prepare  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.rundir import RunDir, write_json_atomic  # noqa: E402

FLOP_CONVENTION = (
    "useful FLOPs/token per trainer/flops.py (PaLM): 6N per weight with gradient, 2N without, "
    "attention 12LHQT (4LHQT without gradient), activation-checkpointing recompute excluded; "
    "over the datasheet bf16 dense peak per device"
)
# The machine a rehearsal plans for: one H200 (the kind of slot this bench is booked on).
REHEARSAL_GPU_GIB, REHEARSAL_GPUS = 141.0, 1
# The rehearsal's width: the tiny preset's block (every other field of the run is kept).
TINY_WIDTH = {"d_model": 64, "n_heads": 4, "mlp_hidden": 176, "vocab_size": 4096}


TINY_CONFIG = "trainer/configs/tiny.yaml"
SHIPPED_CONFIG = "trainer/configs/huginn-3.5b.yaml"  # what operators launch: its layout is plan's


@dataclass(frozen=True)
class GpuRun:
    name: str
    config: str  # the trainer config it starts from, relative to the repository
    settings: tuple[str, ...]  # overrides that make its code path (precision, layout, ...)
    micro_batch: int
    steps: int
    warmup: int  # first steps left out of the medians (compilation, allocator)
    checkpoint_every: int  # 0: one save at the end only
    target: str
    timeout_s: int
    needs_gpu: bool = False  # cannot run on CPU at all (the rehearsal records a skip)
    checkpoints_on_disk: int = 1  # at once: a save of a new one before the old is pruned
    rehearsed_by: str | None = None  # a run whose rehearsal covers this one's code path


ONE_B: tuple[str, ...] = ("model.preset=1b", "train.precision=bf16", "parallel.strategy=fsdp")
ONE_B += ("model.compile=true", "model.activation_checkpointing=false")
ONE_B += ("checkpoint.format=sharded", "checkpoint.async_save=true")
RUNS = (
    GpuRun("1b-mfu", TINY_CONFIG, ONE_B, 2, 12, 3, 0, "MFU >= 45 % on an H200", 900),
    GpuRun(
        "3.5b-step",
        SHIPPED_CONFIG,
        (),
        1,
        4,
        2,
        0,
        "fits in the shipped layout; step time",
        900,
        rehearsed_by="3.5b-async-save",  # the same path, plus the interval save
    ),
    GpuRun(
        "3.5b-async-save",
        SHIPPED_CONFIG,
        ("checkpoint.keep_last=1",),
        1,
        3,
        1,
        2,  # an async save at step 2 (step 3 shows the stall), the final one at step 3
        "save time, loop stall",
        1200,
        checkpoints_on_disk=2,
    ),
    GpuRun(
        "1b-offload",
        TINY_CONFIG,
        (*ONE_B, "parallel.offload=true"),
        2,
        5,
        2,
        0,
        "runs (FSDP2's CPUOffloadPolicy cannot run without a GPU: its only test)",
        600,
        needs_gpu=True,
    ),
)


@dataclass
class Machine:
    gpus: int
    gpu_mem_gib: float
    device: str
    rehearsal: bool
    gpus_per_node: int = 8


def trainer_overrides(run: GpuRun, machine: Machine, args: argparse.Namespace) -> list[str]:
    """What the run sets on its config, on the GPU: its settings, steps, batch, bench logging."""
    out = [*run.settings, "eval.every=0", "metrics.log_every=1", "metrics.port=0"]
    out += [f"checkpoint.interval_steps={run.checkpoint_every or 100000}"]
    out += [f"train.global_batch={run.micro_batch * machine.gpus}"]
    out += [f"train.micro_batch={run.micro_batch}", f"model.mean_recurrence={args.depth}"]
    out += [f"train.steps={args.steps if run.name == '1b-mfu' else run.steps}"]
    return [*out, "train.device=cuda", *args.extra.get(run.name, [])]


def rehearsal_overrides(gpu: list[str], run: GpuRun) -> list[str]:
    """The GPU run's overrides at the tiny width on CPU: 2 sequences of 64 tokens per step (the
    production matrix's shapes, so the two share compiled graphs), depth 2, 2 steps (3 for a run
    that saves on an interval: it reaches its second save); nothing else changes."""
    steps = run.checkpoint_every + 1 if run.checkpoint_every else 2
    out = [*gpu, *(f"model.{k}={v}" for k, v in TINY_WIDTH.items())]
    out += ["model.max_seq_len=64", "model.mean_recurrence=2", "model.backprop_depth=2"]
    out += ["train.global_batch=2", "train.micro_batch=2", f"train.steps={steps}"]
    return [*out, "train.device=cpu"]


def code_path(config: str, overrides: list[str], world: int) -> dict[str, Any]:
    """What decides which code runs: parsed by the trainer's own config loader."""
    from trainer.config import load_config

    cfg = load_config(REPO / config, ["data.path=unused", "run_dir=unused", *overrides])
    return {
        "preset": cfg.preset,
        "strategy": cfg.parallel.strategy,
        "precision": cfg.train.precision,
        "compile": cfg.model.compile,
        "activation_checkpointing": cfg.model.activation_checkpointing,
        "checkpoint_format": cfg.checkpoint.format,
        "async_save": cfg.checkpoint.async_save,
        "offload": cfg.parallel.offload,
        "world_size": world,
        "micro_batch": cfg.train.micro_batch,
    }


def memory_check(path: dict[str, Any], machine: Machine, seq_len: int) -> dict[str, Any]:
    """The plan's estimate (rlmctl/plan.py, as `rlmctl plan` and `launch` compute it) of the GPU
    run's layout on this machine's GPUs: GiB per GPU, usable GiB, whether it fits."""
    estimate = plan.estimate(
        path["preset"],
        None,
        machine.gpu_mem_gib,
        seq_len,
        path["micro_batch"],
        machine.gpus,
        min(machine.gpus, machine.gpus_per_node),
    )
    checkpointing = path["activation_checkpointing"]
    row = next(e for e in estimate.estimates if e.activation_checkpointing == checkpointing)
    layout = "offload" if path["offload"] else path["strategy"]
    needed = row.layouts.per_gpu_gib[layout]
    return {
        "layout": layout,
        "per_gpu_gib": round(needed, 1),
        "usable_gib": round(estimate.usable_gib, 1),
        "fits": needed <= estimate.usable_gib,
        "plan_pick": row.layouts.pick,
        "plan": {"gpus": machine.gpus, "gpu_mem_gib": machine.gpu_mem_gib, "seq_len": seq_len},
    }


def disk_check(run: GpuRun, preset: str, out: Path) -> dict[str, Any]:
    """Free space for the run's checkpoints (12 B per parameter: fp32 weights and AdamW's
    moments), on the GPU machine: the 3.5B save run holds two ~43 GB checkpoints at once."""
    needed = run.checkpoints_on_disk * 12 * plan.shape(preset, None, None)["params"]
    free = shutil.disk_usage(out).free
    return {"needed_gb": round(needed / 1e9, 1), "free_gb": round(free / 1e9, 1)}


def figures(run_dir: Path, warmup: int) -> dict[str, Any]:
    """What one run measured (rank 0's metrics.jsonl and events.jsonl)."""
    records = [r for r in RunDir(run_dir).read_metrics() if r.get("kind") == "train"]
    if not records:
        return {}
    steady = records[warmup:] or records[-1:]
    times = sorted(r["step_time"] for r in steady)
    events = RunDir(run_dir).events()
    saves = [e.fields for e in events if e.kind == "checkpoint"]
    start = next((e.fields for e in events if e.kind == "start"), {})
    return {
        "steps": len(records),
        "measured_steps": len(steady),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady),
        "tflops_per_device": statistics.median(r["tflops"] for r in steady),
        "peak_source": start.get("peak_source"),
        "peak_memory_gib": max(r["peak_memory_bytes"] for r in records) / 2**30,
        "step_time_s": {
            "median": statistics.median(times),
            "min": times[0],
            "max": times[-1],
            "spread": times[-1] / times[0] if times[0] else None,
        },
        "mean_depth": statistics.mean(r["recurrence"] for r in steady),
        "checkpoint_save_s": [round(s["seconds"], 3) for s in saves],
        "checkpoint_bytes": [s["bytes"] for s in saves],
        "flop_convention": FLOP_CONVENTION,
    }


def train(
    config: str, run_dir: Path, data: Path, nproc: int, args: list[str], timeout: int
) -> dict[str, Any]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", "-m", "trainer", "train"]
    command += ["--config", str(REPO / config)]
    command += [f"data.path={data}", f"run_dir={run_dir}", *args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    try:
        result = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        tail: str | bytes = (exc.stderr or b"")[-3000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"status": "timeout", "seconds": timeout, "stderr_tail": tail}
    seconds = time.monotonic() - started
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "error:" in line]
        return {
            "status": "failed",
            "exit_code": result.returncode,
            "seconds": seconds,
            "error": errors[0] if errors else None,  # the first says why; later ones follow
            "errors": errors[:5],
            "stderr_tail": result.stderr[-3000:],
        }
    return {"status": "ok", "seconds": seconds}


def record_fixtures(out: Path, machine: Machine) -> dict[str, str]:
    """The real tools' output on this machine, each file saying where and how it was recorded;
    what could not be recorded, and why."""
    fixtures = out / "fixtures"
    fixtures.mkdir(parents=True, exist_ok=True)
    # datetime.UTC would need Python 3.11; the project supports 3.10.
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    where = f"{socket.gethostname()} ({machine.device}, {machine.gpus} GPU(s))"
    done: dict[str, str] = {}
    for name, command in (
        ("nvidia-smi-q.xml", ["nvidia-smi", "-q", "-x"]),
        ("nvidia-smi-topo-m.txt", ["nvidia-smi", "topo", "-m"]),
    ):
        if shutil.which(command[0]) is None:
            done[name] = f"not recorded: {command[0]} not found on this machine"
            continue
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        header = f"recorded {when} on {where} by bench/gpu.py: `{' '.join(command)}`"
        header += f", exit {result.returncode}"
        text = result.stdout or result.stderr
        if name.endswith(".xml"):  # a comment after the XML declaration keeps it valid XML
            first, _, rest = text.partition("\n")
            body = f"{first}\n<!-- {header} -->\n{rest}" if first.startswith("<?xml") else text
        else:
            body = f"# {header}\n{text}"
        (fixtures / name).write_text(body)
        done[name] = str(fixtures / name)
    nproc = max(1, min(machine.gpus, 8)) if not machine.rehearsal else 2
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", "-m", "trainer.allreduce", "--size-mb", "64"]
    env = dict(os.environ, **DEBUG_ENV, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    backend = "gloo on CPU: a rehearsal, not an NCCL fixture" if machine.rehearsal else "NCCL"
    header = (
        f"# recorded {when} on {where} by bench/gpu.py: NCCL_DEBUG=INFO "
        f"NCCL_DEBUG_SUBSYS=INIT,NET {' '.join(command[1:])} ({backend}), exit {result.returncode}"
    )
    name = "nccl-allreduce-info.log"
    (fixtures / name).write_text(f"{header}\n{result.stdout}{result.stderr}")
    done[name] = str(fixtures / name)
    return done


def detect_machine(rehearse: bool) -> Machine:
    import torch

    if rehearse:
        return Machine(REHEARSAL_GPUS, REHEARSAL_GPU_GIB, "cpu (rehearsal for 1 H200)", True)
    if not torch.cuda.is_available():  # `make bench` on a CPU machine: nothing to measure
        print(
            "bench/gpu.py: no GPU here (torch.cuda.is_available() is False), nothing measured; "
            "`python bench/gpu.py --rehearse` runs the CPU rehearsal"
        )
        sys.exit(0)
    props = torch.cuda.get_device_properties(0)
    return Machine(torch.cuda.device_count(), props.total_memory / 2**30, props.name, False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps of the 1b-mfu run")
    parser.add_argument("--depth", type=int, default=8, help="model.mean_recurrence")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="results and run directories")
    parser.add_argument("--runs", default=",".join(r.name for r in RUNS), help="runs to do")
    parser.add_argument("--rehearse", action="store_true", help="CPU, tiny width, 2 steps")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep runs' checkpoints")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="RUN:KEY=VALUE",
        help="a trainer override for one run, e.g. 1b-mfu:train.micro_batch=1",
    )
    args = parser.parse_args(argv)
    args.extra = {}
    for item in args.override:
        name, _, override = item.partition(":")
        args.extra.setdefault(name, []).append(override)

    machine = detect_machine(args.rehearse)
    if args.gpus:
        machine.gpus = min(args.gpus, machine.gpus) if not args.rehearse else args.gpus
    out = Path(args.out or tempfile.mkdtemp(prefix="rlm-gpu-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    import torch

    results: dict[str, Any] = {"machine": asdict(machine), "torch": torch.__version__, "runs": {}}
    results_path = out / "gpu-bench.json"

    def save() -> None:
        write_json_atomic(results_path, results)

    seq_len = 64 if args.rehearse else 4096
    data = out / f"data-{seq_len}"
    if not (data / METADATA_NAME).exists():
        prepare(data, seq_len=seq_len, vocab_size=4096)
    wanted = set(args.runs.split(","))
    for run in (r for r in RUNS if r.name in wanted):
        entry: dict[str, Any] = {"run": asdict(run), "status": "running"}
        results["runs"][run.name] = entry
        save()
        gpu_overrides = trainer_overrides(run, machine, args)
        try:
            gpu_path = code_path(run.config, gpu_overrides, machine.gpus)
        except UserError as exc:  # a bad --override: this run only
            entry |= {"status": "failed", "error": f"error: {exc}"}
            save()
            print(summary(run.name, entry), flush=True)
            continue
        entry["gpu_code_path"] = gpu_path
        # The estimate is the GPU run's (seq 4096 on this machine's GPUs), in a rehearsal too.
        check = memory_check(gpu_path, machine, 4096)
        entry["memory_check"] = check
        if not check["fits"]:
            entry["status"] = "skipped"
            entry["reason"] = (
                f"plan: {check['per_gpu_gib']} GiB per GPU in layout {check['layout']} does not "
                f"fit {check['usable_gib']} usable GiB (plan picks {check['plan_pick']})"
            )
        elif args.rehearse and run.needs_gpu:
            entry["status"] = "skipped"
            entry["reason"] = "needs a GPU (parallel.offload: FSDP2's CPUOffloadPolicy)"
        elif args.rehearse and run.rehearsed_by in wanted:
            entry["status"] = "skipped"
            entry["reason"] = f"rehearsed by {run.rehearsed_by} (the same code path)"
        elif (
            not args.rehearse
            and (disk := disk_check(run, gpu_path["preset"], out))["needed_gb"] > disk["free_gb"]
        ):
            entry["status"] = "skipped"
            entry["reason"] = (
                f"its checkpoints need {disk['needed_gb']} GB free in {out}, "
                f"{disk['free_gb']} GB are; point --out at a larger filesystem"
            )
        else:
            nproc = REHEARSAL_GPUS if args.rehearse else machine.gpus
            run_overrides = gpu_overrides
            if args.rehearse:
                run_overrides = rehearsal_overrides(gpu_overrides, run)
                entry["code_path"] = code_path(run.config, run_overrides, nproc)
            entry["overrides"] = run_overrides
            entry |= train(run.config, out / run.name, data, nproc, run_overrides, run.timeout_s)
            entry["figures"] = figures(out / run.name, 0 if args.rehearse else run.warmup)
            if not args.keep_checkpoints:  # 12-43 GB each on a GPU machine: make room
                shutil.rmtree(out / run.name / "checkpoints", ignore_errors=True)
        save()
        print(summary(run.name, entry), flush=True)
    results["fixtures"] = record_fixtures(out, machine)
    save()
    for name, where in results["fixtures"].items():
        print(f"fixture {name}: {where}")
    print(f"figures: {results_path}")


def summary(name: str, entry: dict[str, Any]) -> str:
    if entry["status"] != "ok":
        why = entry.get("reason") or entry.get("error") or entry["status"]
        return f"{name}: {entry['status']} ({why})"
    f = entry["figures"]
    if not f:
        return f"{name}: ok, but no steps were recorded"
    saves = f", saves {f['checkpoint_save_s']} s" if f["checkpoint_save_s"] else ""
    return (
        f"{name}: {f['tokens_per_s']:,.0f} tok/s, MFU {100 * f['mfu']:.1f} %, step "
        f"{f['step_time_s']['median']:.2f} s (spread {f['step_time_s']['spread']:.2f}x), peak "
        f"memory {f['peak_memory_gib']:.1f} GiB{saves}; plan {entry['memory_check']['per_gpu_gib']}"
        f" GiB in {entry['memory_check']['layout']}"
    )


if __name__ == "__main__":
    main()

"""The training loop, top to bottom: setup, resume, steps, validation, checkpoints, exit.

One optimizer step:

1. r = sample_recurrence(seed, step) and k = min(backprop_depth, r): the same on every rank.
2. This rank's share of the global positions [cursor, cursor + global_batch), split into
   micro-batches; each sample's latent-state noise is seeded by its global position, so the
   update does not depend on the world size.
3. Forward/backward per micro-batch (DDP all-reduces on the last one), unscale, clip.
4. One small all-reduce agrees on the mean loss and on whether a stop signal arrived anywhere.
5. A finite step is applied; a non-finite one is dropped and counted. After
   `train.max_nonfinite` in a row the run rolls back to the newest verified checkpoint from
   before the streak, with the data cursor still moving forward (or stops, exit 4).
6. Metrics, checkpoint on the interval, validation on its interval, stop if asked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import resource
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

import trainer
from trainer import distributed
from trainer.checkpoint import CheckpointManager
from trainer.config import Config, check_world_size, dump_yaml, to_dict
from trainer.data import (
    GlobalSampler,
    TokenDataset,
    consumed_shards,
    rank_positions,
    sample_seed,
)
from trainer.distributed import DistEnv
from trainer.errors import ConfigError, DataError, UserError
from trainer.evaluate import evaluate
from trainer.flops import flops_per_token, peak_flops
from trainer.metrics import TrainMetrics, log_line, validation_line
from trainer.model import RecurrentLM, sample_recurrence
from trainer.optim import build_optimizer, build_scheduler
from trainer.rundir import ExitCode, RunDir, append_jsonl, write_json_atomic

log = logging.getLogger("trainer")

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class StopSignals:
    """SIGTERM/SIGUSR1 ask for a clean stop after the current step; a second SIGTERM exits now."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGTERM:
            # The operator insists: no checkpoint, restartable exit code.
            sys.stderr.write(f"{name} again: exiting without a checkpoint\n")
            os._exit(ExitCode.FAILED)
        self.requested = name
        sys.stderr.write(f"{name}: stopping after this step and saving a checkpoint\n")


@dataclass
class Progress:
    """Where training stands; everything a resume needs besides the tensors."""

    step: int = 0  # optimizer steps done
    tokens: int = 0  # tokens trained on
    cursor: int = 0  # global sample position of the next step
    nonfinite_steps: int = 0
    nonfinite_in_a_row: int = 0
    rollbacks: int = 0  # by this process; train.max_rollbacks is the budget
    skipped_steps: int = 0  # fp16 steps the loss scaler skipped
    comm_bytes_total: int = 0


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def open_data(cfg: Config) -> tuple[TokenDataset, TokenDataset | None]:
    """The train (and val) splits, checked against the model before any other work."""
    path = Path(cfg.data.path)
    if not path.exists():
        raise DataError(
            f"data.path {path} does not exist; prepare it with "
            f"`python -m trainer prepare --out {path}` or set data.path"
        )
    train_ds = TokenDataset(path, cfg.data.split)
    if train_ds.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"data in {path} has vocab size {train_ds.vocab_size} but model.vocab_size is "
            f"{cfg.model.vocab_size}; set model.vocab_size={train_ds.vocab_size} or larger"
        )
    if train_ds.seq_len > cfg.model.max_seq_len:
        raise DataError(
            f"data in {path} has sequences of {train_ds.seq_len} tokens but model.max_seq_len "
            f"is {cfg.model.max_seq_len}; raise model.max_seq_len or prepare with --seq-len"
        )
    val_ds = TokenDataset(path, cfg.eval.split) if cfg.eval.every else None
    return train_ds, val_ds


def load_batch(
    ds: TokenDataset, indices: list[int], positions: list[int], seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(inputs, shifted labels, per-sample state seeds) for one micro-batch."""
    samples = torch.stack([ds[i] for i in indices]).to(device, non_blocking=True)
    seeds = [sample_seed(seed, p) for p in positions]
    return samples[:, :-1], samples[:, 1:], seeds


def chunks(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def autocast(env: DistEnv, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(env.device.type, dtype=PRECISION_DTYPES[precision])


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rng_state(device: torch.device) -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def train(cfg: Config) -> ExitCode:
    """Run training to `train.steps` (or until stopped); returns the process exit code."""
    # First of all: a SIGTERM while the data or a checkpoint loads must be a clean stop too.
    signals = StopSignals()
    signals.install()
    try:
        return _setup_and_train(cfg, signals)
    finally:
        signals.restore()


def _setup_and_train(cfg: Config, signals: StopSignals) -> ExitCode:
    # Everything that can be wrong with the input is checked before the process group forms.
    world_size = distributed.world_size_from_env()
    accum_steps = check_world_size(cfg, world_size)
    train_ds, val_ds = open_data(cfg)

    env = distributed.init(cfg.comm, cfg.train.device)
    setup_logging(env.rank)
    run_dir = RunDir(cfg.run_dir)
    metrics: TrainMetrics | None = None
    progress = Progress()
    state = "starting"
    exit_code = ExitCode.FAILED
    try:
        if env.is_main:
            run_dir.create()
            run_dir.config_path.write_text(dump_yaml(cfg), encoding="utf-8")
            # A restart keeps the previous step and loss visible until the first new step.
            previous = run_dir.read_status()
            previous.pop("exit_code", None)
            run_dir.write_status(**{**previous, "state": "starting", "updated": time.time()})
            metrics = TrainMetrics(run_dir.name, cfg.checkpoint.interval_steps)
            if cfg.metrics.port:
                try:
                    port = metrics.serve(cfg.metrics.host, cfg.metrics.port)
                except OSError as exc:
                    raise ConfigError(
                        f"cannot serve metrics on {cfg.metrics.host}:{cfg.metrics.port} "
                        f"({exc.strerror}); choose another metrics.port, or 0 to disable"
                    ) from None
                log.info("metrics on http://%s:%d/metrics", cfg.metrics.host, port)
        # Also a barrier: the run directory exists before any rank writes into it.
        summary = distributed.startup_check(env, cfg.comm)
        if summary:
            log.info("%s", summary)
        exit_code, state = _train(
            cfg, env, run_dir, metrics, progress, train_ds, val_ds, accum_steps, signals
        )
    except UserError as exc:
        exit_code, state = exc.exit_code, "failed"
        raise
    except BaseException:
        exit_code, state = ExitCode.FAILED, "failed"
        raise
    finally:
        if env.is_main:
            _write_exit(run_dir, cfg, progress, state, exit_code, metrics)
        if metrics is not None:
            metrics.close()
        distributed.shutdown(env)
    return exit_code


def _write_exit(
    run_dir: RunDir,
    cfg: Config,
    progress: Progress,
    state: str,
    exit_code: ExitCode,
    metrics: TrainMetrics | None,
) -> None:
    with contextlib.suppress(OSError):  # a full or vanished filesystem must not mask the error
        status = run_dir.read_status()
        status.update(
            state=state,
            step=progress.step,
            exit_code=int(exit_code),
            checkpoint_interval_steps=cfg.checkpoint.interval_steps,
            max_steps=cfg.train.steps,
            updated=time.time(),
        )
        write_json_atomic(run_dir.status_path, status)
        run_dir.append_event("exit", exit_code=int(exit_code), state=state, step=progress.step)
    if metrics is not None:
        metrics.set_state(state)


def _train(
    cfg: Config,
    env: DistEnv,
    run_dir: RunDir,
    metrics: TrainMetrics | None,
    progress: Progress,
    train_ds: TokenDataset,
    val_ds: TokenDataset | None,
    accum_steps: int,
    signals: StopSignals,
) -> tuple[ExitCode, str]:
    mcfg, tcfg = cfg.model, cfg.train
    # Built on the meta device and initialised in place: a 3.5 B model never materialises in
    # host memory eight times per node. Same seed, same weights on every rank.
    with torch.device("meta"):
        model = RecurrentLM(mcfg)
    model.to_empty(device=env.device)
    torch.manual_seed(cfg.seed)
    model.init_weights()
    optimizer = build_optimizer(model, cfg.optim, env.device)
    scheduler = build_scheduler(optimizer, cfg.optim, tcfg.steps)
    scaler = torch.amp.GradScaler(env.device.type) if tcfg.precision == "fp16" else None
    sampler = GlobalSampler(len(train_ds), cfg.seed)
    checkpoints = CheckpointManager(run_dir, cfg.checkpoint, env.rank, env.world_size)

    resumed = checkpoints.load()
    if resumed is not None:
        _restore(resumed, model, optimizer, scheduler, scaler, progress, train_ds, env)
    # Backprop depth 0 leaves the core without gradients; DDP must then look for unused params.
    ddp_model = distributed.wrap_model(model, env, cfg.comm, find_unused=mcfg.backprop_depth == 0)
    comm = distributed.comm_stats(ddp_model)
    params = [p for p in model.parameters() if p.requires_grad]

    seq_len = train_ds.seq_len
    tokens_per_step = tcfg.global_batch * seq_len
    dtype = PRECISION_DTYPES[tcfg.precision]
    peak, peak_source = peak_flops(env.device, dtype) if env.is_main else (0.0, "")
    if env.is_main:
        counts = model.param_counts()
        log.info(
            "model %s: %.2fM parameters (%.2fM non-embedding); world %d, %d micro-batches of %d "
            "per rank per step, %d tokens/step; peak %.2f TFLOP/s (%s)",
            cfg.preset,
            counts.total / 1e6,
            counts.non_embedding / 1e6,
            env.world_size,
            accum_steps,
            tcfg.micro_batch,
            tokens_per_step,
            peak / 1e12,
            peak_source,
        )
        run_dir.append_event(
            "start",
            step=progress.step,
            world_size=env.world_size,
            host=socket.gethostname(),
            pid=os.getpid(),
            resumed_from=str(checkpoints.loaded_path) if checkpoints.loaded_path else None,
        )
        run_dir.write_status(
            state="running",
            step=progress.step,
            loss=None,
            tokens_per_s=None,
            checkpoint_interval_steps=cfg.checkpoint.interval_steps,
            max_steps=tcfg.steps,
        )
        assert metrics is not None
        metrics.set_state("running")

    # A stop asked for during setup (while the checkpoint loaded, say): nothing new to save.
    if distributed.all_reduce_sum([1.0 if signals.requested else 0.0], env)[0]:
        log.info("stop requested during setup: exiting before the first step, nothing to save")
        return ExitCode.OK, "stopped"

    def save_checkpoint() -> None:
        # Collective (RNG states are gathered from every rank); only rank 0 writes.
        rng = distributed.gather_objects(rng_state(env.device), env)
        checkpoints.save(
            progress.step,
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler else None,
                "progress": {
                    "step": progress.step,
                    "tokens": progress.tokens,
                    "sample_index": progress.cursor,
                    "epoch": sampler.epoch(progress.cursor),
                    "data_fingerprint": train_ds.fingerprint,
                    "consumed_shards": consumed_shards(train_ds, sampler, progress.cursor)
                    if env.is_main
                    else [],
                    "nonfinite_steps": progress.nonfinite_steps,
                    "skipped_steps": progress.skipped_steps,
                },
                "rng": rng,
                "config": to_dict(cfg),
                "version": trainer.__version__,
            },
        )
        if metrics is not None:
            metrics.update(
                {
                    "step": progress.step,
                    "checkpoint_saves": checkpoints.saves,
                    "checkpoint_failures": checkpoints.failures,
                }
            )

    last_saved = progress.step if resumed is not None else None
    while progress.step < tcfg.steps:
        step_start = time.perf_counter()
        step = progress.step
        r = sample_recurrence(cfg.seed, step, mcfg.mean_recurrence, mcfg.recurrence_sigma)
        k = min(mcfg.backprop_depth, r)
        positions = rank_positions(progress.cursor, tcfg.global_batch, env.rank, env.world_size)
        indices = sampler.indices(positions)
        if tcfg.ledger:
            ledger = run_dir.path / f"ledger-rank{env.rank}.jsonl"
            append_jsonl(ledger, {"step": step, "positions": positions, "indices": indices})

        # The poison follows the data (like a bad shard would): a rollback that moves the
        # cursor past the bad range does not meet it again.
        poisoned = progress.cursor // tcfg.global_batch + 1 in tcfg.debug_nan_steps
        loss_sum = torch.zeros((), device=env.device)
        data_time = 0.0
        micro = list(
            zip(
                chunks(indices, tcfg.micro_batch),
                chunks(positions, tcfg.micro_batch),
                strict=True,
            )
        )
        for i, (micro_indices, micro_positions) in enumerate(micro):
            data_start = time.perf_counter()
            inputs, labels, seeds = load_batch(
                train_ds, micro_indices, micro_positions, cfg.seed, env.device
            )
            data_time += time.perf_counter() - data_start
            last = i == len(micro) - 1
            # Gradients are all-reduced once per step, on the last micro-batch.
            sync = contextlib.nullcontext() if last or ddp_model is model else ddp_model.no_sync()
            with sync:
                with autocast(env, tcfg.precision):
                    out = ddp_model(
                        inputs, labels, num_steps=r, backprop_depth=k, state_seeds=seeds
                    )
                loss = out.loss / len(micro)
                if poisoned:
                    loss = loss * math.nan
                (scaler.scale(loss) if scaler else loss).backward()
            loss_sum += loss.detach()

        if scaler:
            scaler.unscale_(optimizer)
        max_norm = tcfg.grad_clip if tcfg.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        loss_total, stop_votes = distributed.all_reduce_sum(
            [float(loss_sum), 1.0 if signals.requested else 0.0], env
        )
        loss_value = loss_total / env.world_size
        lr = scheduler.get_last_lr()[0]

        # With fp16 an overflowing gradient is the loss scaler's business (it skips the
        # step and lowers the scale); a non-finite loss is trouble in every precision.
        finite = math.isfinite(loss_value) and (scaler is not None or math.isfinite(grad_norm))
        if scaler:
            scale_before = scaler.get_scale()
            if finite:
                scaler.step(optimizer)
            scaler.update()
            if finite and scaler.get_scale() < scale_before:
                progress.skipped_steps += 1
        elif finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

        progress.step += 1
        progress.cursor += tcfg.global_batch
        progress.tokens += tokens_per_step
        step_comm = comm.take() if comm else 0
        progress.comm_bytes_total += step_comm
        if finite:
            progress.nonfinite_in_a_row = 0
        else:
            progress.nonfinite_steps += 1
            progress.nonfinite_in_a_row += 1
            log.warning(
                "step %d: non-finite loss %s / grad norm %s; update dropped (%d in a row)",
                progress.step,
                loss_value,
                grad_norm,
                progress.nonfinite_in_a_row,
            )
            if env.is_main:
                run_dir.append_event(
                    "nonfinite",
                    step=progress.step,
                    loss=str(loss_value),
                    grad_norm=str(grad_norm),
                )

        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        step_time = time.perf_counter() - step_start
        if env.is_main:
            assert metrics is not None
            flops = flops_per_token(mcfg, r, k, seq_len).useful * tokens_per_step
            flops_per_device = flops / env.world_size / step_time
            record = {
                "kind": "train",
                "step": progress.step,
                "loss": loss_value if math.isfinite(loss_value) else str(loss_value),
                "lr": lr,
                "grad_norm": grad_norm if math.isfinite(grad_norm) else str(grad_norm),
                "tokens": progress.tokens,
                "tokens_per_s": tokens_per_step / step_time,
                "step_time": step_time,
                "data_time": data_time,
                "recurrence": r,
                "backprop_depth": k,
                "comm_bytes": step_comm,
                "comm_wire_bytes": comm.ring_wire_bytes(step_comm) if comm else 0.0,
                "tflops": flops_per_device / 1e12,
                "mfu": flops_per_device / peak if peak else 0.0,
                "peak_memory_bytes": peak_memory_bytes(env.device),
                "loss_scale": scaler.get_scale() if scaler else None,
                "time": time.time(),
            }
            run_dir.append_metrics(record)
            metrics.update(
                {
                    **record,
                    "loss": loss_value,
                    "grad_norm": grad_norm,
                    "comm_bytes_total": progress.comm_bytes_total,
                    "nonfinite_steps": progress.nonfinite_steps,
                    "skipped_steps": progress.skipped_steps,
                    "checkpoint_saves": checkpoints.saves,
                    "checkpoint_failures": checkpoints.failures,
                }
            )
            if progress.step % cfg.metrics.log_every == 0 or progress.step == tcfg.steps:
                log.info(
                    "%s",
                    log_line(record | {"loss": loss_value, "grad_norm": grad_norm}, tcfg.steps),
                )
                run_dir.write_status(
                    state="running",
                    step=progress.step,
                    loss=loss_value if math.isfinite(loss_value) else None,
                    tokens_per_s=record["tokens_per_s"],
                    checkpoint_interval_steps=cfg.checkpoint.interval_steps,
                    max_steps=tcfg.steps,
                )

        if progress.nonfinite_in_a_row >= tcfg.max_nonfinite:
            checkpoints.wait()  # an async save in flight may be the rollback target
            if not _roll_back(
                cfg, env, run_dir, checkpoints, progress, model, optimizer, scheduler, scaler
            ):
                return ExitCode.NONFINITE, "failed"
            last_saved = progress.step
            continue

        final = progress.step == tcfg.steps
        if progress.step % cfg.checkpoint.interval_steps == 0 or final or stop_votes:
            save_checkpoint()
            last_saved = progress.step
        if val_ds is not None and (progress.step % cfg.eval.every == 0 or final):
            losses = evaluate(model, val_ds, cfg, env)
            _report_validation(losses, progress.step, run_dir, metrics, env)
        if stop_votes:
            log.info("stopped at step %d on request; checkpoint saved", progress.step)
            checkpoints.wait()
            return ExitCode.OK, "stopped"
    if last_saved != progress.step:
        save_checkpoint()
    checkpoints.wait()
    return ExitCode.OK, "done"


def _report_validation(
    losses: dict[int, float],
    step: int,
    run_dir: RunDir,
    metrics: TrainMetrics | None,
    env: DistEnv,
) -> None:
    if not env.is_main:
        return
    perplexity = {d: math.exp(min(loss, 50.0)) for d, loss in losses.items()}
    run_dir.append_metrics(
        {
            "kind": "val",
            "step": step,
            "val_loss": {str(d): v for d, v in losses.items()},
            "perplexity": {str(d): v for d, v in perplexity.items()},
            "time": time.time(),
        }
    )
    assert metrics is not None
    metrics.update_validation(perplexity)
    log.info("%s", validation_line(step, losses, perplexity))


def _restore(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None,
    progress: Progress,
    train_ds: TokenDataset,
    env: DistEnv,
) -> None:
    _load_tensors(state, model, optimizer, scheduler, scaler)
    saved = state["progress"]
    progress.step = saved["step"]
    progress.tokens = saved["tokens"]
    progress.cursor = saved["sample_index"]
    progress.nonfinite_steps = saved.get("nonfinite_steps", 0)
    progress.skipped_steps = saved.get("skipped_steps", 0)
    if saved.get("data_fingerprint") != train_ds.fingerprint:
        log.warning(
            "resuming on different data (fingerprint %s, checkpoint has %s): the data order "
            "continues at sample %d of the new dataset",
            train_ds.fingerprint,
            saved.get("data_fingerprint"),
            progress.cursor,
        )
    rng = state.get("rng") or []
    if len(rng) == env.world_size:
        set_rng_state(rng[env.rank], env.device)
    log.info("resumed at step %d (%d tokens)", progress.step, progress.tokens)


def _load_tensors(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None,
) -> None:
    """Model, optimizer, scheduler and grad-scaler state of a checkpoint, loaded in place."""
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(
            f"the checkpoint does not fit this model/optimizer config ({first}); "
            "use the config it was trained with, or checkpoint.resume=never"
        ) from None
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])


def _roll_back(
    cfg: Config,
    env: DistEnv,
    run_dir: RunDir,
    checkpoints: CheckpointManager,
    progress: Progress,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None,
) -> bool:
    """Reload the newest verified checkpoint from before the non-finite streak; False: stop.

    The data cursor is not restored: the samples between that checkpoint and now are skipped, so
    a bad stretch of data is not replayed. Checkpoints saved during the streak hold the weights
    that led into it and are not candidates.
    """
    tcfg = cfg.train
    streak_start = progress.step - progress.nonfinite_in_a_row + 1
    reason = (
        f"{progress.nonfinite_in_a_row} non-finite steps in a row at steps {streak_start}-"
        f"{progress.step} (train.max_nonfinite={tcfg.max_nonfinite})"
    )
    if tcfg.on_nonfinite == "stop":
        log.error("error: %s; stopping (train.on_nonfinite=stop)", reason)
        return False
    if progress.rollbacks >= tcfg.max_rollbacks:
        log.error(
            "error: %s; rollback budget train.max_rollbacks=%d used up; stopping",
            reason,
            tcfg.max_rollbacks,
        )
        return False
    target = checkpoints.latest_before(streak_start) if env.is_main else None
    path = distributed.broadcast_object(str(target.path) if target else None, env)
    if path is None:
        log.error(
            "error: %s; no verified checkpoint before step %d to roll back to; stopping",
            reason,
            streak_start,
        )
        return False
    state = checkpoints.read(Path(path))
    _load_tensors(state, model, optimizer, scheduler, scaler)
    checkpoints.set_aside_newer(state["progress"]["step"])
    from_step = progress.step
    progress.step = state["progress"]["step"]
    progress.tokens = state["progress"]["tokens"]
    progress.nonfinite_in_a_row = 0
    progress.rollbacks += 1
    log.warning(
        "%s; rolled back to %s (rollback %d of train.max_rollbacks=%d); the data continues at "
        "sample %d, samples %d..%d are skipped",
        reason,
        Path(path).name,
        progress.rollbacks,
        tcfg.max_rollbacks,
        progress.cursor,
        state["progress"]["sample_index"],
        progress.cursor - 1,
    )
    if env.is_main:
        run_dir.append_event(
            "rollback",
            from_step=from_step,
            to_step=progress.step,
            checkpoint=path,
            cursor=progress.cursor,
            skipped_samples=progress.cursor - state["progress"]["sample_index"],
            rollbacks=progress.rollbacks,
        )
    return True

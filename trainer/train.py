"""The training loop, top to bottom: setup, resume, steps, validation, checkpoints, exit.

The loop (`_loop`) wires components together and reads on one screen: the stateful components
(trainer/components.py) are registered with a `CheckpointManager` that decides what is saved and
when; `train_step` runs one optimizer step and returns a `StepResult`; one `Reporter`
(trainer/metrics.py) writes metrics.jsonl, status.json, events and the Prometheus series from it.

One optimizer step:

1. r = sample_recurrence(seed, step) and k = min(backprop_depth, r): the same on every rank.
2. This rank's share of the global positions [cursor, cursor + global_batch), split into
   micro-batches; each sample's latent-state noise is seeded by its global position, so the
   update does not depend on the world size.
3. Forward/backward per micro-batch (DDP all-reduces on the last one), unscale, clip.
4. One small all-reduce agrees on the mean loss and on whether a stop signal arrived anywhere.
5. A finite step is applied (once an async checkpoint in flight has copied the tensors); a
   non-finite one is dropped and counted. After `train.max_nonfinite` in a row the run rolls
   back to the newest verified checkpoint from before the streak, with the data cursor still
   moving forward (or stops, exit 4).
6. Metrics, checkpoint on the interval, validation on its interval, stop if asked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import trainer
from trainer import comm_path, distributed, parallel
from trainer.checkpoint import CheckpointManager, CheckpointStore, Ranks
from trainer.components import DataCursor, Progress, StepHealth, TrainState
from trainer.config import Config, check_world_size, dump_yaml, to_dict
from trainer.data import TokenDataset, sample_seed
from trainer.distributed import CommStats, DistEnv
from trainer.errors import ConfigError, DataError, UserError
from trainer.evaluate import evaluate
from trainer.flops import peak_flops
from trainer.hooks import TrainHooks, hooks_from_env
from trainer.metrics import Reporter, StepResult
from trainer.model import RecurrentLM, sample_recurrence
from trainer.optim import build_optimizer, build_scheduler
from trainer.rundir import EventKind, ExitCode, RunDir, RunDirBusy, RunDirUnwritable
from trainer.stop_signals import StopSignals

log = logging.getLogger("trainer")

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
    train_ds = TokenDataset(path, cfg.data.split, verify=cfg.data.verify)
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
    val_ds = TokenDataset(path, cfg.eval.split, verify=cfg.data.verify) if cfg.eval.every else None
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


def recurrence_depths(cfg: Config, step: int, micro_batches: int) -> list[int]:
    """The depth of each micro-batch of `step`: one draw for the whole step (`train.depth_per=
    step`, the default) or one per micro-batch index (the reference run; the same on every rank,
    but a resume on another world size changes the number of micro-batches and so the draws)."""
    m = cfg.model
    if cfg.train.depth_per == "step":
        r = sample_recurrence(cfg.seed, step, m.mean_recurrence, m.recurrence_sigma)
        return [r] * micro_batches
    return [
        sample_recurrence(cfg.seed, step, m.mean_recurrence, m.recurrence_sigma, micro_batch=i)
        for i in range(micro_batches)
    ]


def set_deterministic(cfg: Config) -> None:
    """`train.deterministic`: deterministic kernels only (an op without one raises)."""
    if not cfg.train.deterministic:
        return
    # cuBLAS needs a fixed workspace to be deterministic; set before the first CUDA call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def train(
    cfg: Config, hooks: TrainHooks | None = None, signals: StopSignals | None = None
) -> ExitCode:
    """Run training to `train.steps` (or until stopped); returns the process exit code.

    `hooks` (tests only; default: those named by RLM_TRAINER_HOOKS, else none) inject faults.
    `signals`: handlers the caller installed earlier (the CLI, before torch loads); else here.
    """
    if signals is not None:
        return _setup_and_train(cfg, signals, hooks or hooks_from_env())
    # First of all: a SIGTERM while the data or a checkpoint loads must be a clean stop too.
    signals = StopSignals()
    signals.install()
    try:
        return _setup_and_train(cfg, signals, hooks or hooks_from_env())
    finally:
        signals.restore()


def _setup_and_train(cfg: Config, signals: StopSignals, hooks: TrainHooks) -> ExitCode:
    # Everything that can be wrong with the input is checked before the process group forms.
    try:
        world_size = distributed.world_size_from_env()
        accum_steps = check_world_size(cfg, world_size)
        on_accelerator = distributed.use_accelerator(cfg.train.device)
        parallel.check_strategy(cfg, world_size, on_accelerator)
        train_ds, val_ds = open_data(cfg)
        set_deterministic(cfg)
        comm_log = comm_path.capture(cfg.run_dir) if on_accelerator else None
        env = distributed.init(cfg.comm, cfg.train.device)
    except BaseException as exc:
        # Rank 0 (every rank hits the same input) records it in a run directory that rlmctl
        # made; a trainer started by hand with a wrong path leaves nothing behind.
        if distributed.rank_from_env() == 0 and RunDir(cfg.run_dir).path.is_dir():
            if isinstance(exc, UserError) and exc.exit_code in REFUSALS:
                _record_refusal(RunDir(cfg.run_dir), exc)
            else:  # the rendezvous failed, a peer missing: restartable
                code = exc.exit_code if isinstance(exc, UserError) else ExitCode.FAILED
                with contextlib.suppress(OSError):
                    RunDir(cfg.run_dir).append_event(
                        EventKind.EXIT, exit_code=int(code), state="failed", step=None
                    )
        raise
    setup_logging(env.rank)
    run_dir = RunDir(cfg.run_dir)
    reporter = Reporter(cfg, env, run_dir)
    run = None
    state, exit_code, failure = "starting", ExitCode.FAILED, None
    owner = contextlib.ExitStack()  # rank 0 holds the run directory while this process lives
    previous: dict[str, Any] = {}
    holding = not env.is_main  # another live trainer's run directory: this one records nothing
    try:
        if env.is_main:
            previous = _own_run_dir(run_dir, cfg, owner)
            holding = True
            signals.on_abort = lambda: _record_exit(
                reporter, run_dir, previous, "failed", ExitCode.FAILED, run, None
            )
        reporter.serve_metrics()
        hooks.before_startup_check(env)
        # Also a barrier: the run directory exists before any rank writes into it.
        summary = distributed.startup_check(env, cfg.comm)
        if summary:
            log.info("%s", summary)
        path = comm_path.describe(comm_log)
        if path and env.is_main:
            log.info("comm path: %s", path["summary"])
            run_dir.append_event(
                EventKind.COMM_PATH, transports=path["transports"], summary=path["summary"]
            )
        run = Run.build(cfg, env, train_ds, hooks)
        exit_code, state = _loop(run, cfg, env, run_dir, reporter, signals, val_ds, accum_steps)
    except UserError as exc:
        exit_code, state, failure = exc.exit_code, "failed", exc
        raise
    except BaseException:
        exit_code, state = ExitCode.FAILED, "failed"
        raise
    finally:
        if holding:
            _record_exit(reporter, run_dir, previous, state, exit_code, run, failure)
        reporter.close()
        owner.close()
        distributed.shutdown(env, run.ddp_model if run is not None else None)
    return exit_code


def _own_run_dir(run_dir: RunDir, cfg: Config, owner: contextlib.ExitStack) -> dict[str, Any]:
    """Lock the run directory for this trainer (one line naming the holder if another live one
    has it), make it, write the effective config once; the status an earlier run left."""
    try:
        owner.enter_context(run_dir.hold())
        run_dir.create()
        if not run_dir.config_path.exists():  # written once: a resume never rewrites it
            run_dir.config_path.write_text(dump_yaml(cfg), encoding="utf-8")
    except RunDirBusy as exc:
        raise ConfigError(str(exc)) from None
    except (RunDirUnwritable, OSError) as exc:
        owner.close()
        message = str(exc) if isinstance(exc, RunDirUnwritable) else run_dir._unwritable(exc)
        raise ConfigError(message) from None
    return run_dir.read_status()


REFUSALS = (ExitCode.BAD_CONFIG, ExitCode.DATA_ERROR)


def _record_refusal(run_dir: RunDir, error: UserError) -> None:
    """A refused start (bad config or checkpoint.resume, data or checkpoints unusable, before
    the first step): a `start_refused` event with the code and the one-line reason, and the
    `exit` event every exit appends, without a state. status.json and the run's folded state
    (`RunDir.state`) stay what the earlier attempt left: nothing was started."""
    code = int(error.exit_code)
    with contextlib.suppress(OSError):  # an unwritable directory: the error line is the record
        run_dir.append_event(EventKind.START_REFUSED, exit_code=code, reason=str(error))
        run_dir.append_event(EventKind.EXIT, exit_code=code, state=None, step=None)


def _record_exit(
    reporter: Reporter,
    run_dir: RunDir,
    previous: dict[str, Any],
    state: str,
    exit_code: ExitCode,
    run: Run | None,
    failure: UserError | None,
) -> None:
    """The exit event, and status.json once this attempt has written it (`Reporter.starting`,
    after the checkpoint is loaded). Before that, a refused start records only its refusal, and
    another failure (a peer missing at the startup check) writes status.json unless an earlier
    run left it finished: then that status (done at step 20, say) stays as it was."""
    if not reporter.env.is_main:
        return
    if reporter.status_written:
        reporter.exit(state, exit_code, run.progress.step if run else 0)
        return
    if failure is not None and failure.exit_code in REFUSALS:
        _record_refusal(run_dir, failure)
        return
    if previous.get("state") not in ("done", "stopped", "failed"):
        reporter.exit(state, exit_code, run.progress.step if run else 0)
        return
    with contextlib.suppress(OSError):
        run_dir.append_event(EventKind.EXIT, exit_code=int(exit_code), state=state, step=None)


@dataclass
class Run:
    """The components of one training run, built from the config (same seed, same weights on
    every rank)."""

    model: RecurrentLM
    ddp_model: torch.nn.Module  # the model as DDP wraps it (the model itself at world size 1)
    tensors: TrainState
    scaler: torch.amp.GradScaler | None
    progress: Progress
    health: StepHealth
    cursor: DataCursor
    comm: CommStats | None
    dataset: TokenDataset
    hooks: TrainHooks

    @classmethod
    def build(cls, cfg: Config, env: DistEnv, dataset: TokenDataset, hooks: TrainHooks) -> Run:
        # Built on the meta device and initialised in place: a 3.5 B model never materialises in
        # host memory eight times per node. FSDP/HSDP shard it while still on meta, so each rank
        # allocates only its shards; the optimizer then holds the shards.
        with torch.device("meta"):
            model = RecurrentLM(cfg.model)
        sharded = cfg.parallel.strategy != "ddp" and env.distributed
        comm = parallel.shard_model(model, cfg, env) if sharded else None
        model.to_empty(device=env.device)
        torch.manual_seed(cfg.seed)
        if sharded:
            parallel.init_sharded_weights(model)
        else:
            model.init_weights()
        optimizer = build_optimizer(model, cfg.optim, env.device)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
        scaler = torch.amp.GradScaler(env.device.type) if cfg.train.precision == "fp16" else None
        sharded_checkpoints = cfg.checkpoint.format == "sharded"
        tensors = TrainState(model, optimizer, scheduler, scaler, sharded_checkpoints)
        return cls(
            model,
            model,
            tensors,
            scaler,
            Progress(),
            StepHealth(),
            DataCursor(dataset, cfg.seed, env),
            comm,
            dataset,
            hooks,
        )

    def checkpoint_manager(self, cfg: Config, env: DistEnv, run_dir: RunDir) -> CheckpointManager:
        """What a checkpoint of this run holds, and which parts a rollback restores."""
        sharded = cfg.checkpoint.format == "sharded" and env.distributed
        ranks = Ranks(
            broadcast=lambda obj: distributed.broadcast_object(obj, env),
            gather=lambda obj: distributed.gather_objects(obj, env),
            checkpoint_group=distributed.side_group(cfg.comm) if sharded else None,
            hosts=env.hosts,
        )
        store = CheckpointStore(run_dir, cfg.checkpoint, env.rank, env.world_size, ranks)
        store.tensor_template = self.tensors.tensor_template
        store.read_hook = lambda path: self.hooks.on_checkpoint_read(env.rank, path)
        store.write_hook = lambda path: self.hooks.on_checkpoint_write(env.rank, path)
        store.phase_hook = lambda phase: self.hooks.on_checkpoint_phase(env.rank, phase)
        constants = {"config": to_dict(cfg), "version": trainer.__version__}
        manager = CheckpointManager(store, cfg.checkpoint.interval_steps, constants)
        manager.register(self.tensors, rolled_back=True)
        manager.register(self.progress, rolled_back=True)
        manager.register(self.cursor)
        manager.register(self.health)
        return manager

    def wrap(self, cfg: Config, env: DistEnv) -> None:
        """DDP around the model, after a resume loaded its weights (a sharded model is already
        wrapped). Backprop depth 0 leaves the core without gradients; DDP must then look for
        unused parameters."""
        if parallel.is_sharded(self.model):
            return
        find_unused = cfg.model.backprop_depth == 0
        self.ddp_model = distributed.wrap_model(self.model, env, cfg.comm, find_unused=find_unused)
        self.comm = distributed.comm_stats(self.ddp_model)


def _loop(
    run: Run,
    cfg: Config,
    env: DistEnv,
    run_dir: RunDir,
    reporter: Reporter,
    signals: StopSignals,
    val_ds: TokenDataset | None,
    accum_steps: int,
) -> tuple[ExitCode, str]:
    checkpoints = run.checkpoint_manager(cfg, env, run_dir)
    if checkpoints.load():
        log.info("resumed at step %d (%d tokens)", run.progress.step, run.progress.tokens)
    reporter.starting()  # from here on the start can no longer be refused
    run.wrap(cfg, env)
    peak = (
        peak_flops(env.device, PRECISION_DTYPES[cfg.train.precision]) if env.is_main else (0.0, "")
    )
    counts = run.model.param_counts()
    reporter.started(
        run.progress.step, counts, accum_steps, run.dataset.seq_len, peak, run.comm, checkpoints
    )
    # A stop asked for during setup (while the checkpoint loaded, say): nothing new to save.
    if distributed.all_reduce_sum([1.0 if signals.requested else 0.0], env)[0]:
        log.info("stop requested during setup: exiting before the first step, nothing to save")
        return ExitCode.OK, "stopped"

    failures_before = checkpoints.failures
    while run.progress.step < cfg.train.steps:
        result = train_step(run, cfg, env, run_dir, signals, checkpoints.wait_for_staging)
        reporter.step(result, run.health)
        if run.health.nonfinite_in_a_row >= cfg.train.max_nonfinite:
            if not _roll_back(run, cfg, checkpoints, reporter):
                return ExitCode.NONFINITE, "failed"
            continue
        final = result.step == cfg.train.steps
        failures_before = checkpoints.failures
        if checkpoints.save(result.step, last=final or result.stop_requested):
            reporter.checkpoint_saved(result.step)
        if val_ds is not None and (result.step % cfg.eval.every == 0 or final):
            reporter.validation(result.step, evaluate(run.model, val_ds, cfg, env))
        if result.stop_requested:
            if not _last_save_ok(checkpoints, failures_before):
                return ExitCode.FAILED, "failed"
            log.info("stopped at step %d on request; checkpoint saved", result.step)
            return ExitCode.OK, "stopped"
    if checkpoints.save(run.progress.step, last=True):
        reporter.checkpoint_saved(run.progress.step)
    if not _last_save_ok(checkpoints, failures_before):
        return ExitCode.FAILED, "failed"
    return ExitCode.OK, "done"


def _last_save_ok(checkpoints: CheckpointManager, failures_before: int) -> bool:
    """A run is only done (or cleanly stopped) when its last checkpoint is on disk; with
    checkpoint.on_error=continue a failed last save is a restartable failure instead."""
    checkpoints.wait()
    if checkpoints.failures > failures_before:
        log.error(
            "error: the last checkpoint was not saved; exiting 1 (a restart redoes the steps)"
        )
        return False
    return True


def train_step(
    run: Run,
    cfg: Config,
    env: DistEnv,
    run_dir: RunDir,
    signals: StopSignals,
    before_update: Callable[[], None],
) -> StepResult:
    """One optimizer step over this rank's share of the next global batch. `before_update` runs
    before the optimizer changes the weights and its state in place: an async checkpoint's copy
    of them must be done by then (`CheckpointManager.wait_for_staging`)."""
    mcfg, tcfg = cfg.model, cfg.train
    tensors, scaler = run.tensors, run.scaler
    step_start = time.perf_counter()
    positions, indices = run.cursor.batch(tcfg.global_batch)
    run.hooks.on_batch(run_dir.path, env.rank, run.progress.step, positions, indices)

    loss_sum = torch.zeros((), device=env.device)
    data_time = 0.0
    micro = list(
        zip(chunks(indices, tcfg.micro_batch), chunks(positions, tcfg.micro_batch), strict=True)
    )
    depths = recurrence_depths(cfg, run.progress.step, len(micro))
    for i, (micro_indices, micro_positions) in enumerate(micro):
        r = depths[i]
        k = min(mcfg.backprop_depth, r)
        data_start = time.perf_counter()
        inputs, labels, seeds = load_batch(
            run.dataset, micro_indices, micro_positions, cfg.seed, env.device
        )
        data_time += time.perf_counter() - data_start
        last = i == len(micro) - 1
        # Gradients are all-reduced (or reduce-scattered) once per step, on the last micro-batch.
        ddp = run.ddp_model
        with parallel.gradient_sync(ddp, sync=last):
            with autocast(env, tcfg.precision):
                out = ddp(inputs, labels, num_steps=r, backprop_depth=k, state_seeds=seeds)
            loss = run.hooks.loss(out.loss / len(micro), run.cursor.position, tcfg.global_batch)
            (scaler.scale(loss) if scaler else loss).backward()
        loss_sum += loss.detach()

    optimizer = tensors.optimizer
    if scaler:
        scaler.unscale_(optimizer)
    params = [p for p in run.model.parameters() if p.requires_grad]
    grad_norm = parallel.clip_grad_norm(params, tcfg.grad_clip)
    loss_total, stop_votes = distributed.all_reduce_sum(
        [float(loss_sum), 1.0 if signals.requested else 0.0], env
    )
    loss_value = loss_total / env.world_size
    lr = float(tensors.scheduler.get_last_lr()[0])  # typed float | Tensor; ours is a float

    # With fp16 an overflowing gradient is the loss scaler's business (it skips the step and
    # lowers the scale); a non-finite loss is trouble in every precision.
    finite = math.isfinite(loss_value) and (scaler is not None or math.isfinite(grad_norm))
    before_update()
    if scaler:
        scale_before = scaler.get_scale()
        if finite:
            scaler.step(optimizer)
        scaler.update()
        if finite and scaler.get_scale() < scale_before:
            run.health.skipped_steps += 1
    elif finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tensors.scheduler.step()

    tokens_per_step = tcfg.global_batch * run.dataset.seq_len
    run.progress.step += 1
    run.progress.tokens += tokens_per_step
    run.cursor.advance(tcfg.global_batch)
    run.health.record(finite)
    distributed.synchronize(env.device)
    comm_time = run.comm.timer.take() if run.comm else 0.0
    return StepResult(
        step=run.progress.step,
        loss=loss_value,
        grad_norm=grad_norm,
        lr=lr,
        finite=finite,
        recurrence=round(sum(depths) / len(depths)),
        backprop_depth=round(sum(min(mcfg.backprop_depth, d) for d in depths) / len(depths)),
        tokens=run.progress.tokens,
        tokens_per_step=tokens_per_step,
        step_time=time.perf_counter() - step_start,
        data_time=data_time,
        comm_bytes=run.comm.take() if run.comm else 0,
        comm_time=comm_time,
        loss_scale=scaler.get_scale() if scaler else None,
        stop_requested=bool(stop_votes),
    )


def _roll_back(run: Run, cfg: Config, checkpoints: CheckpointManager, reporter: Reporter) -> bool:
    """Reload the newest verified checkpoint from before the non-finite streak; False: stop.

    The data cursor is not restored: the samples between that checkpoint and now are skipped, so
    a bad stretch of data is not replayed. Checkpoints saved during the streak hold the weights
    that led into it and are not candidates.
    """
    checkpoints.wait()  # an async save in flight may be the rollback target, or fail
    tcfg, health = cfg.train, run.health
    from_step = run.progress.step
    streak_start = from_step - health.nonfinite_in_a_row + 1
    reason = (
        f"{health.nonfinite_in_a_row} non-finite steps in a row at steps {streak_start}-"
        f"{from_step} (train.max_nonfinite={tcfg.max_nonfinite})"
    )
    if tcfg.on_nonfinite == "stop":
        log.error("error: %s; stopping (train.on_nonfinite=stop)", reason)
        return False
    if health.rollbacks >= tcfg.max_rollbacks:
        log.error(
            "error: %s; rollback budget train.max_rollbacks=%d used up; stopping",
            reason,
            tcfg.max_rollbacks,
        )
        return False
    restored = checkpoints.roll_back(streak_start)
    if restored is None:
        log.error(
            "error: %s; no verified checkpoint before step %d to roll back to; stopping",
            reason,
            streak_start,
        )
        return False
    path, state = restored
    health.nonfinite_in_a_row = 0
    health.rollbacks += 1
    cursor, saved_cursor = run.cursor.position, state["progress"]["sample_index"]
    log.warning(
        "%s; rolled back to %s (rollback %d of train.max_rollbacks=%d); the data continues at "
        "sample %d, samples %d..%d are skipped",
        reason,
        path.name,
        health.rollbacks,
        tcfg.max_rollbacks,
        cursor,
        saved_cursor,
        cursor - 1,
    )
    reporter.event(
        "rollback",
        from_step=from_step,
        to_step=run.progress.step,
        checkpoint=str(path),
        cursor=cursor,
        skipped_samples=cursor - saved_cursor,
        rollbacks=health.rollbacks,
    )
    return True

"""What the trainer reports, all from one `Reporter`: metrics.jsonl, status.json, events.jsonl,
log lines, and the Prometheus endpoint with `/healthz` on rank 0.

The loop hands the reporter typed results (`StepResult`, validation losses, checkpoint saves);
the reporter alone decides what goes where. The files are written through `trainer.rundir.RunDir`;
`TrainMetrics` turns the same per-step records into `rlm_train_*` series (names fixed by
docs/architecture.md, base units, every series labelled with the run name) on a private
registry, so that several trainers in one process (tests) never collide. A new trainer metric
touches this module and docs/trainer.md, nothing else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app

from trainer.checkpoint import CheckpointManager
from trainer.components import StepHealth
from trainer.config import Config
from trainer.distributed import CommStats, DistEnv
from trainer.errors import ConfigError
from trainer.evaluate import perplexity
from trainer.flops import flops_per_token
from trainer.model import ParamCounts
from trainer.rankstats import RankTimes
from trainer.rundir import EventKind, ExitCode, RunDir, write_json_atomic

log = logging.getLogger("trainer")

# Train-record field → gauge name. Counters are fed from running totals instead (see `_advance`).
_GAUGES = {
    "step": ("rlm_train_step", "Last completed optimizer step"),
    "loss": ("rlm_train_loss", "Training loss of the last step (mean over the global batch)"),
    "tokens_per_s": ("rlm_train_tokens_per_second", "Training throughput of the last step"),
    "mfu": ("rlm_train_mfu_ratio", "Model FLOPs utilisation per device (useful FLOPs / peak)"),
    "recurrence": ("rlm_train_recurrence_depth", "Core iterations r of the last step"),
    "backprop_depth": ("rlm_train_backprop_depth", "Differentiated core iterations k"),
    "step_time": ("rlm_train_step_duration_seconds", "Wall time of the last optimizer step"),
    "lr": ("rlm_train_learning_rate", "Learning rate of the last step"),
    "grad_norm": ("rlm_train_grad_norm", "Global gradient norm before clipping"),
    "peak_memory_bytes": ("rlm_train_peak_memory_bytes", "Peak device (or host) memory, rank 0"),
    "time": ("rlm_train_last_step_timestamp_seconds", "Unix time the last step finished"),
}
_COUNTERS = {
    "tokens": ("rlm_train_tokens", "Tokens trained on"),
    "comm_bytes_total": ("rlm_train_comm_bytes", "Gradient bytes rank 0 handed to all-reduce"),
    "nonfinite_steps": ("rlm_train_nonfinite_steps", "Steps dropped for a non-finite loss/grad"),
    "skipped_steps": ("rlm_train_skipped_steps", "fp16 steps skipped by the loss scaler"),
    "checkpoint_saves": ("rlm_train_checkpoint_saves", "Checkpoints saved"),
    "checkpoint_failures": ("rlm_train_checkpoint_failures", "Checkpoint saves that failed"),
}


class TrainMetrics:
    """The `rlm_train_*` series of one run, and the HTTP endpoint that serves them."""

    def __init__(self, run: str, checkpoint_interval_steps: int) -> None:
        self.run = run
        self.registry = CollectorRegistry()
        self._gauges = {
            key: Gauge(name, doc, ["run"], registry=self.registry).labels(run=run)
            for key, (name, doc) in _GAUGES.items()
        }
        self._counters = {
            key: Counter(name, doc, ["run"], registry=self.registry).labels(run=run)
            for key, (name, doc) in _COUNTERS.items()
        }
        self._totals = dict.fromkeys(_COUNTERS, 0.0)
        self._val_ppl = Gauge(
            "rlm_train_val_perplexity",
            "Validation perplexity at a fixed recurrence depth",
            ["run", "depth"],
            registry=self.registry,
        )
        interval = Gauge(
            "rlm_train_checkpoint_interval_steps",
            "Configured steps between checkpoints",
            ["run"],
            registry=self.registry,
        )
        interval.labels(run=run).set(checkpoint_interval_steps)
        self._flops = Gauge(
            "rlm_train_flops_per_second",
            "Achieved useful FLOP/s per device",
            ["run"],
            registry=self.registry,
        ).labels(run=run)
        self.health: dict[str, Any] = {"state": "starting", "step": 0, "updated": time.time()}
        self._server: WSGIServer | None = None

    def update(self, record: dict[str, Any]) -> None:
        """Apply one train record (a metrics.jsonl line, plus running totals)."""
        for key, gauge in self._gauges.items():
            if record.get(key) is not None:
                gauge.set(record[key])
        if record.get("tflops") is not None:
            self._flops.set(record["tflops"] * 1e12)
        for key in self._counters:
            if record.get(key) is not None:
                self._advance(key, record[key])
        self.health.update(step=record.get("step", 0), updated=time.time())

    def _advance(self, key: str, total: float) -> None:
        # Counters only go up: feed them the difference to the running total (a resumed run
        # starts its token counter at the restored total).
        delta = total - self._totals[key]
        if delta > 0:
            self._counters[key].inc(delta)
            self._totals[key] = total

    def update_validation(self, perplexity: dict[int, float]) -> None:
        for depth, value in perplexity.items():
            self._val_ppl.labels(run=self.run, depth=str(depth)).set(value)

    def set_state(self, state: str) -> None:
        self.health.update(state=state, updated=time.time())

    # HTTP -----------------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> int:
        """Serve /metrics and /healthz from a daemon thread; returns the bound port."""
        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            if environ.get("PATH_INFO") == "/healthz":
                body = dict(self.health, seconds_since_update=time.time() - self.health["updated"])
                status = "503 Service Unavailable" if body["state"] == "failed" else "200 OK"
                start_response(status, [("Content-Type", "application/json")])
                return [json.dumps(body).encode() + b"\n"]
            return metrics_app(environ, start_response)

        self._server = make_server(host, port, app, _ThreadingServer, _QuietHandler)
        thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        thread.start()
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not log-worthy
        pass


def log_line(record: dict[str, Any], max_steps: int) -> str:
    """One concise human line per `metrics.log_every` steps."""
    parts = [
        f"step {record['step']}/{max_steps}",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.2e}",
        f"gnorm {record['grad_norm']:.3f}",
        f"r {record['recurrence']} k {record['backprop_depth']}",
        f"{record['tokens_per_s']:,.0f} tok/s",
        f"mfu {100 * record['mfu']:.2f}%",
        f"{1000 * record['step_time']:.0f} ms/step",
    ]
    return " | ".join(parts)


def validation_line(step: int, losses: dict[int, float], perplexity: dict[int, float]) -> str:
    depths = "  ".join(f"r={d}: {perplexity[d]:.2f}" for d in sorted(perplexity))
    return f"val step {step} perplexity  {depths}"


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did, as `train_step` returns it."""

    step: int  # optimizer steps done after this one
    loss: float  # mean over the global batch; may be nan/inf
    grad_norm: float  # before clipping; may be nan/inf
    lr: float  # the learning rate this step used
    finite: bool  # False: the update was dropped
    recurrence: int  # core iterations r
    backprop_depth: int  # differentiated iterations k
    tokens: int  # tokens trained on so far
    tokens_per_step: int
    step_time: float
    data_time: float
    comm_bytes: int  # gradient bytes this rank handed to all-reduce in this step
    comm_time: float  # seconds this rank's gradient collectives ran (trainer.commtime)
    loss_scale: float | None  # fp16 grad scaler's scale after the step
    stop_requested: bool  # some rank received SIGTERM/SIGUSR1


def peak_memory_bytes(device: torch.device) -> int:
    if device.type != "cpu":
        return getattr(torch, device.type).max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _finite_or_text(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


class Reporter:
    """The one writer of metrics.jsonl, status.json, events.jsonl and the Prometheus series.

    Files and series are written on rank 0 only; warnings are logged on every rank.
    """

    def __init__(self, cfg: Config, env: DistEnv, run_dir: RunDir) -> None:
        self.cfg, self.env, self.run_dir = cfg, env, run_dir
        self.metrics: TrainMetrics | None = None
        self.comm: CommStats | None = None
        self.peak = 0.0
        self.seq_len = 0
        self.comm_bytes_total = 0
        self.checkpoints: CheckpointManager | None = None
        self.status_written = False  # this attempt has written status.json (`starting`)
        # Step and communication seconds since status.json was last written: it carries their
        # means over the window, which the exporter turns into the communication share.
        self.window = [0, 0.0, 0.0]  # steps, step seconds, comm seconds
        # Checkpoint stall already reported, and when and at which stall the newest step was
        # recorded: what goodput (runcontract.goodput) needs beyond the step times.
        self._stall_reported = 0.0
        self._recorded = (time.time(), 0.0)
        self.ranks: RankTimes | None = None

    def _status(self, **fields: Any) -> None:
        self.run_dir.write_status(
            **fields,
            checkpoint_interval_steps=self.cfg.checkpoint.interval_steps,
            max_steps=self.cfg.train.steps,
        )

    def event(self, kind: str, **fields: Any) -> None:
        if self.env.is_main:
            self.run_dir.append_event(EventKind(kind), **fields)

    def serve_metrics(self) -> None:
        """The Prometheus endpoint and /healthz ("starting") come up; a port in use is a
        config error, before anything is written."""
        if not self.env.is_main:
            return
        self.metrics = TrainMetrics(self.run_dir.name, self.cfg.checkpoint.interval_steps)
        host, port = self.cfg.metrics.host, self.cfg.metrics.port
        if port:
            try:
                port = self.metrics.serve(host, port)
            except OSError as exc:
                raise ConfigError(
                    f"cannot serve metrics on {host}:{port} ({exc.strerror}); "
                    "choose another metrics.port, or 0 to disable"
                ) from None
            log.info("metrics on http://%s:%d/metrics", host, port)

    def starting(self) -> None:
        """status.json says "starting" (keeping the previous step and loss visible until the first
        new step): the first write of status.json by this attempt, once the checkpoint is loaded
        and the start can no longer be refused (a refused start leaves status.json alone)."""
        self.status_written = True
        if not self.env.is_main:
            return
        previous = self.run_dir.read_status()
        previous.pop("exit_code", None)
        self.run_dir.write_status(**{**previous, "state": "starting", "updated": time.time()})

    def started(
        self,
        step: int,
        counts: ParamCounts,
        accum_steps: int,
        seq_len: int,
        peak: tuple[float, str],
        comm: CommStats | None,
        checkpoints: CheckpointManager,
    ) -> None:
        """The loop is about to run its first step."""
        self.comm, self.seq_len, self.peak = comm, seq_len, peak[0]
        self.checkpoints = checkpoints
        self.ranks = RankTimes(self.env, self.run_dir, self.cfg.metrics.log_every)
        resumed_from = str(checkpoints.loaded_path) if checkpoints.loaded_path else None
        if not self.env.is_main:
            return
        tcfg = self.cfg.train
        log.info(
            "model %s: %.2fM parameters (%.2fM non-embedding); world %d, %d micro-batches of %d "
            "per rank per step, %d tokens/step; peak %.2f TFLOP/s (%s)",
            self.cfg.preset,
            counts.total / 1e6,
            counts.non_embedding / 1e6,
            self.env.world_size,
            accum_steps,
            tcfg.micro_batch,
            tcfg.global_batch * seq_len,
            peak[0] / 1e12,
            peak[1],
        )
        self.event(
            "start",
            step=step,
            world_size=self.env.world_size,
            host=socket.gethostname(),
            pid=os.getpid(),
            resumed_from=resumed_from,
            seq_len=seq_len,
            device=self.env.device.type,
            peak_source=peak[1],  # "datasheet H100 (NVIDIA H100 80GB HBM3)": the SKU for accept
        )
        self._status(state="running", step=step, loss=None, tokens_per_s=None)
        assert self.metrics is not None
        self.metrics.set_state("running")

    def _take_stall(self) -> float:
        """Seconds the loop was blocked by checkpointing since the previous call."""
        total = self.checkpoints.stall_seconds if self.checkpoints else 0.0
        stall, self._stall_reported = total - self._stall_reported, total
        return stall

    def step(self, result: StepResult, health: StepHealth) -> None:
        """One optimizer step: a metrics.jsonl record, the series, a log line and status.json
        every `metrics.log_every` steps, a `nonfinite` event for a dropped update; every rank's
        step figures to ranks.json every `metrics.log_every` steps (a collective)."""
        if self.ranks is not None:
            self.ranks.add(result)
        self.comm_bytes_total += result.comm_bytes
        self.window = [
            self.window[0] + 1,
            self.window[1] + result.step_time,
            self.window[2] + result.comm_time,
        ]
        if not result.finite:
            log.warning(
                "step %d: non-finite loss %s / grad norm %s; update dropped (%d in a row)",
                result.step,
                result.loss,
                result.grad_norm,
                health.nonfinite_in_a_row,
            )
            self.event(
                "nonfinite",
                step=result.step,
                loss=str(result.loss),
                grad_norm=str(result.grad_norm),
            )
        if not self.env.is_main:
            return
        assert self.metrics is not None
        mcfg = self.cfg.model
        flops = flops_per_token(mcfg, result.recurrence, result.backprop_depth, self.seq_len)
        per_device = flops.useful * result.tokens_per_step / self.env.world_size / result.step_time
        record: dict[str, Any] = {
            "kind": "train",
            "step": result.step,
            "loss": _finite_or_text(result.loss),
            "lr": result.lr,
            "grad_norm": _finite_or_text(result.grad_norm),
            "tokens": result.tokens,
            "tokens_per_s": result.tokens_per_step / result.step_time,
            "step_time": result.step_time,
            "data_time": result.data_time,
            "recurrence": result.recurrence,
            "backprop_depth": result.backprop_depth,
            "comm_bytes": result.comm_bytes,
            "comm_wire_bytes": self.comm.ring_wire_bytes(result.comm_bytes) if self.comm else 0.0,
            "comm_time": result.comm_time,
            "tflops": per_device / 1e12,
            "mfu": per_device / self.peak if self.peak else 0.0,
            "peak_memory_bytes": peak_memory_bytes(self.env.device),
            "loss_scale": result.loss_scale,
            "checkpoint_stall": self._take_stall(),
            "time": time.time(),
        }
        self.run_dir.append_metrics(record)
        self._recorded = (record["time"], self._stall_reported)
        numbers = {"loss": result.loss, "grad_norm": result.grad_norm}
        self.metrics.update(
            {
                **record,
                **numbers,
                "comm_bytes_total": self.comm_bytes_total,
                "nonfinite_steps": health.nonfinite_steps,
                "skipped_steps": health.skipped_steps,
                "checkpoint_saves": self.checkpoints.saves if self.checkpoints else 0,
                "checkpoint_failures": self.checkpoints.failures if self.checkpoints else 0,
            }
        )
        if result.step % self.cfg.metrics.log_every == 0 or result.step == self.cfg.train.steps:
            log.info("%s", log_line(record | numbers, self.cfg.train.steps))
            steps, step_time, comm_time = self.window
            self.window = [0, 0.0, 0.0]
            self._status(
                state="running",
                step=result.step,
                loss=result.loss if math.isfinite(result.loss) else None,
                tokens_per_s=record["tokens_per_s"],
                step_time=step_time / steps,
                comm_time=comm_time / steps,
            )

    def checkpoint_saved(self, step: int) -> None:
        if self.metrics is not None and self.checkpoints is not None:
            saves, failures = self.checkpoints.saves, self.checkpoints.failures
            self.metrics.update(
                {"step": step, "checkpoint_saves": saves, "checkpoint_failures": failures}
            )

    def validation(self, step: int, losses: dict[int, float]) -> None:
        if not self.env.is_main:
            return
        ppl = {d: perplexity(loss) for d, loss in losses.items()}
        now = time.time()
        recorded, stall = self._recorded
        stalled = (self.checkpoints.stall_seconds if self.checkpoints else 0.0) - stall
        self.run_dir.append_metrics(
            {
                "kind": "val",
                "step": step,
                "val_loss": {str(d): v for d, v in losses.items()},
                "perplexity": {str(d): v for d, v in ppl.items()},
                "seconds": max(0.0, now - recorded - stalled),  # since the step, less its save
                "time": now,
            }
        )
        assert self.metrics is not None
        self.metrics.update_validation(ppl)
        log.info("%s", validation_line(step, losses, ppl))

    def exit(self, state: str, exit_code: ExitCode, step: int) -> None:
        """The last word of this process: status.json, an `exit` event, /healthz state."""
        if not self.env.is_main:
            return
        with contextlib.suppress(OSError):  # a full or vanished filesystem must not mask the error
            status = self.run_dir.read_status()
            status.update(
                state=state,
                step=step,
                exit_code=int(exit_code),
                checkpoint_interval_steps=self.cfg.checkpoint.interval_steps,
                max_steps=self.cfg.train.steps,
                updated=time.time(),
            )
            write_json_atomic(self.run_dir.status_path, status)
            stall = self._take_stall()  # the last save, and the wait for an async one
            self.run_dir.append_event(
                EventKind.EXIT,
                exit_code=int(exit_code),
                state=state,
                step=step,
                checkpoint_stall=stall,
            )
        if self.metrics is not None:
            self.metrics.set_state(state)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

"""What the trainer reports: log lines, and the Prometheus endpoint with `/healthz` on rank 0.

metrics.jsonl and status.json are written through `trainer.rundir.RunDir`; this module turns the
same per-step records into `rlm_train_*` series (names fixed by docs/architecture.md, base units,
every series labelled with the run name) on a private registry, so that several trainers in one
process (tests) never collide.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app

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

"""`rlmctl accept RUN`: the go-live verdict of a run, one criterion per line.

Each criterion reads one source: the run directory (runcontract/rundir.py: metrics.jsonl, events,
checkpoints, launcher logs), Prometheus over its HTTP API when `rlm_prometheus_url` is set
(urllib only; HTTPS verified with `rlm_monitoring_tls_ca`, basic auth as `rlm_monitoring_username`), and the last `rlmctl health` report (topology and communication path). Verdicts:
PASS, FAIL, NO DATA (the source has nothing yet, or does not answer: the reason says which) and
N/A (the criterion does not apply, e.g. a GPU criterion on a CPU run). The run is accepted when
no criterion FAILs; the verdict lists what was not checked. Thresholds: `rlm_accept_thresholds`
(clusterspec/variables.yml, docs/acceptance.md).
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import ssl
import statistics
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clusterspec import vendors
from clusterspec.variables import default
from rlmctl.charts import Chart, Threshold, render
from runcontract.rundir import RunDir
from runcontract.states import EventKind

PASS, FAIL, NO_DATA, NA = "PASS", "FAIL", "NO DATA", "N/A"
REPORT_NAME = "acceptance.md"
PLOTS_DIR = "acceptance"


@dataclass
class Criterion:
    """One row of the verdict: `threshold` and `measured` in words for people, `value` and
    `limit` as numbers in `unit` for scripts (None where nothing was measured)."""

    name: str
    threshold: str
    measured: str
    verdict: str
    source: str
    reason: str = ""
    value: float | None = None
    unit: str = ""
    limit: float | None = None


@dataclass
class Verdict:
    run: str
    criteria: list[Criterion]
    report: str | None = None
    plots: list[str] = field(default_factory=list)
    goodput: dict[str, Any] | None = None  # where the wall time went (runcontract.goodput)

    @property
    def accepted(self) -> bool:
        return not any(c.verdict == FAIL for c in self.criteria)

    @property
    def not_checked(self) -> list[str]:
        return [c.name for c in self.criteria if c.verdict in (NO_DATA, NA)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "accepted": self.accepted,
            "criteria": [asdict(c) for c in self.criteria],
            "not_checked": self.not_checked,
            "report": self.report,
            "plots": self.plots,
            "goodput": self.goodput,
        }


def thresholds(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The inventory's rlm_accept_thresholds over the spec's defaults; unknown keys are errors."""
    merged = default("rlm_accept_thresholds")
    unknown = sorted(set(overrides or {}) - set(merged))
    if unknown:
        raise ValueError(
            f"rlm_accept_thresholds has unknown keys {', '.join(unknown)}; "
            f"known: {', '.join(sorted(merged))}"
        )
    merged.update(overrides or {})
    return merged


# -- the run directory -------------------------------------------------------------------------
@dataclass
class RunData:
    train: list[dict[str, Any]]
    val: list[dict[str, Any]]
    events: list[dict[str, Any]]
    run_dir: RunDir

    @classmethod
    def load(cls, run_dir: RunDir) -> RunData:
        records = read_records(run_dir.metrics_path)
        return cls(
            train=[r for r in records if r.get("kind") == "train"],
            val=[r for r in records if r.get("kind") == "val"],
            events=read_records(run_dir.events_path),
            run_dir=run_dir,
        )

    def start(self) -> dict[str, Any]:
        starts = [e for e in self.events if e.get("event") == EventKind.START]
        return starts[-1] if starts else {}


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file of the run directory, checked: a last line without its
    newline is a writer still busy (skipped); anything else that is not a JSON object (binary
    garbage, another file copied over it) is a one-line error naming the file and line."""
    from rlmctl.errors import RlmctlError

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as error:
        raise RlmctlError(f"cannot read {path}: {error.strerror}") from None
    lines = data.split(b"\n")
    records = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        torn = number == len(lines)  # no newline after it yet
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            problem = "is not text (not UTF-8)"
        except ValueError:
            if torn:
                continue
            problem = "is not JSON"
        else:
            if isinstance(record, dict):
                records.append(record)
                continue
            problem = f"is a JSON {type(record).__name__}, not a record"
        raise RlmctlError(
            f"{path} is not JSON lines as the trainer writes them: line {number} {problem}; "
            "restore the file, or move it aside (accept then has no data from it)"
        )
    return records


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _no_metrics(name: str, threshold: str) -> Criterion:
    return Criterion(name, threshold, "-", NO_DATA, "metrics.jsonl", "no training steps logged yet")


def tflops_per_gpu(data: RunData, t: dict[str, Any]) -> Criterion:
    name, source = "TFLOPS per GPU", "metrics.jsonl tflops"
    start = data.start()
    if start.get("device") == "cpu" and t["tflops_per_gpu"] is None:
        return Criterion(name, "-", "-", NA, source, "CPU run: no GPU datasheet peak to judge by")
    threshold = t["tflops_per_gpu"]
    why: str | None = "rlm_accept_thresholds"
    if threshold is None:
        threshold, why = vendors.golive_tflops(str(start.get("peak_source", "")))
    if threshold is None:
        sku = start.get("peak_source") or "no start event"
        return Criterion(
            name, "-", "-", NO_DATA, source,
            f"unknown SKU ({sku}): set rlm_accept_thresholds.tflops_per_gpu",
        )  # fmt: skip
    values = [v for r in data.train if (v := _number(r.get("tflops"))) is not None]
    if not values:
        return _no_metrics(name, f">= {threshold:g}")
    steady = values[len(values) // 2 :]  # the second half: compile and warm-up left out
    measured = statistics.median(steady)
    verdict = PASS if measured >= threshold else FAIL
    return Criterion(
        name, f">= {threshold:g} ({why})", f"{measured:.4g} median", verdict, source,
        value=measured, unit="TFLOP/s", limit=threshold,
    )  # fmt: skip


def loss_falling(data: RunData, t: dict[str, Any]) -> Criterion:
    """Slope of the loss over the last window, after removing each sampled depth's own mean:
    a deep sample has a lower loss than a shallow one at the same step, so the raw series jumps
    with the depth schedule; within-depth residuals do not."""
    name, pct = "loss falling", t["loss_window_pct"]
    threshold = f"slope < 0 over the last {pct:g}% of steps"
    points = [
        (r["step"], loss, r.get("recurrence"))
        for r in data.train
        if (loss := _number(r.get("loss"))) is not None
    ]
    if len(points) < t["min_points"]:
        return Criterion(
            name, threshold, f"{len(points)} steps", NO_DATA, "metrics.jsonl loss",
            f"fewer than {t['min_points']} logged steps",
        )  # fmt: skip
    window = points[-max(t["min_points"], int(len(points) * pct / 100)) :]
    by_depth: dict[Any, list[float]] = {}
    for _, loss, depth in window:
        by_depth.setdefault(depth, []).append(loss)
    means = {depth: statistics.fmean(losses) for depth, losses in by_depth.items()}
    steps = [float(s) for s, _, _ in window]
    residuals = [loss - means[depth] for _, loss, depth in window]
    slope = _slope(steps, residuals)
    change = slope * (steps[-1] - steps[0])
    measured = f"{change:+.4f} over steps {int(steps[0])}-{int(steps[-1])}"
    return Criterion(
        name, threshold, measured, PASS if slope < 0 else FAIL, "metrics.jsonl loss, recurrence",
        value=change, unit="loss change over the window", limit=0.0,
    )  # fmt: skip


def _val_depths(data: RunData) -> list[dict[str, float]]:
    out = []
    for record in data.val:
        ppl = record.get("perplexity") or {}
        out.append({str(d): float(v) for d, v in ppl.items() if _number(v) is not None})
    return out


def val_ppl_falling(data: RunData, t: dict[str, Any]) -> Criterion:
    name, source = "val perplexity falling at every depth", "metrics.jsonl val perplexity"
    evals = _val_depths(data)
    if len(evals) < 2:
        return Criterion(
            name, "last < first per depth", f"{len(evals)} evaluations", NO_DATA, source,
            "needs two validation passes (eval.every)",
        )  # fmt: skip
    first, last = evals[0], evals[-1]
    depths = sorted(set(first) & set(last), key=int)
    stuck = [d for d in depths if not last[d] < first[d]]
    measured = ", ".join(f"d{d} {first[d]:.4g}->{last[d]:.4g}" for d in depths)
    reason = f"not falling at depth {', '.join(stuck)}" if stuck else ""
    verdict = FAIL if stuck or not depths else PASS
    worst = max((last[d] / first[d] for d in depths if first[d]), default=None)
    return Criterion(
        name, "last < first per depth", measured, verdict, source, reason,
        value=worst, unit="last/first perplexity, worst depth", limit=1.0,
    )  # fmt: skip


def ppl_falls_with_depth(data: RunData, t: dict[str, Any]) -> Criterion:
    name, source = "perplexity falling with depth", "metrics.jsonl val perplexity (last pass)"
    evals = _val_depths(data)
    threshold = f"each deeper depth <= shallower x{1 + t['depth_tolerance']:g}"
    if not evals or len(evals[-1]) < 2:
        return Criterion(
            name, threshold, "-", NO_DATA, source, "needs a validation pass at two or more depths"
        )
    last = evals[-1]
    depths = sorted(last, key=int)
    rising = [
        f"d{a}->d{b}"
        for a, b in itertools.pairwise(depths)
        if last[b] > last[a] * (1 + t["depth_tolerance"])
    ]
    measured = ", ".join(f"d{d} {last[d]:.4g}" for d in depths)
    reason = "rises at " + ", ".join(rising) if rising else ""
    worst = max((last[b] / last[a] for a, b in itertools.pairwise(depths) if last[a]), default=None)
    return Criterion(
        name, threshold, measured, FAIL if rising else PASS, source, reason,
        value=worst, unit="deeper/shallower perplexity, worst pair",
        limit=1 + t["depth_tolerance"],
    )  # fmt: skip


def grad_norm_stable(data: RunData, t: dict[str, Any]) -> Criterion:
    name, source = "grad-norm stability (seq >= 1024)", "metrics.jsonl grad_norm"
    k, min_seq = t["grad_spike_k"], t["grad_min_seq_len"]
    threshold = f"no step > {k:g} x median"
    seq_len = data.start().get("seq_len")
    if isinstance(seq_len, int) and seq_len < min_seq:
        return Criterion(name, threshold, f"seq_len {seq_len}", NA, source, f"seq_len < {min_seq}")
    norms = [(r["step"], v) for r in data.train if (v := _number(r.get("grad_norm"))) is not None]
    if len(norms) < t["min_points"]:
        return Criterion(name, threshold, f"{len(norms)} steps", NO_DATA, source, "too few steps")
    norms = norms[len(norms) // 20 :]  # the first 5 %: warm-up norms are large by nature
    median = statistics.median(v for _, v in norms)
    spikes = [s for s, v in norms if v > k * median]
    peak = max(v for _, v in norms)
    measured = f"max {peak / median:.3g} x median {median:.3g}"
    reason = f"spikes at steps {spikes[:5]}" if spikes else ""
    return Criterion(
        name, threshold, measured, FAIL if spikes else PASS, source, reason,
        value=peak / median if median else None, unit="x median grad norm", limit=k,
    )  # fmt: skip


def lr_smooth(data: RunData, t: dict[str, Any]) -> Criterion:
    name, source = "learning-rate curve smooth", "metrics.jsonl lr"
    threshold = f"step-to-step change <= {t['lr_max_jump']:.0%} of peak"
    lrs = [(r["step"], v) for r in data.train if (v := _number(r.get("lr"))) is not None]
    if len(lrs) < 2:
        return Criterion(name, threshold, "-", NO_DATA, source, "fewer than two steps")
    peak = max(v for _, v in lrs) or 1.0
    jumps = [
        (b[0], abs(b[1] - a[1]) / peak / max(1, b[0] - a[0])) for a, b in itertools.pairwise(lrs)
    ]
    worst_step, worst = max(jumps, key=lambda j: j[1])
    verdict = PASS if worst <= t["lr_max_jump"] else FAIL
    reason = f"jump at step {worst_step}" if verdict == FAIL else ""
    return Criterion(
        name, threshold, f"max {worst:.2%} of peak", verdict, source, reason,
        value=worst, unit="fraction of peak LR per step", limit=t["lr_max_jump"],
    )  # fmt: skip


def checkpoints_ok(data: RunData, t: dict[str, Any]) -> Criterion:
    name, source = "checkpoints saved and verified", "checkpoints/ manifests"
    limit = t["checkpoint_max_interval"]
    threshold = f"interval <= {limit} steps, every one valid"
    infos = data.run_dir.checkpoints(full=t["checkpoint_full_verify"])
    last_step = data.train[-1]["step"] if data.train else 0
    if not infos:
        if last_step <= limit:
            return Criterion(
                name, threshold, "none yet", NO_DATA, source, f"run at step {last_step}"
            )
        return Criterion(name, threshold, "none", FAIL, source, f"step {last_step}, no checkpoint")
    steps = sorted(i.step for i in infos)
    # Older checkpoints are pruned (checkpoint.keep_last): judge the kept ones, the configured
    # interval and the steps since the newest one.
    gaps = [b - a for a, b in itertools.pairwise(steps)] + [max(0, last_step - steps[-1])]
    gaps.append(_configured_interval(data.run_dir) or 0)
    bad = [f"{i.path.name}: {i.reason}" for i in infos if not i.valid]
    measured = f"{len(infos)} checkpoints, max gap {max(gaps)} steps, {len(bad)} invalid"
    failed = bad or max(gaps) > limit
    reason = "; ".join(bad[:3]) or (f"gap {max(gaps)} > {limit}" if failed else "")
    return Criterion(
        name, threshold, measured, FAIL if failed else PASS, source, reason,
        value=max(gaps), unit="steps between checkpoints", limit=limit,
    )  # fmt: skip


def _configured_interval(run_dir: RunDir) -> int | None:
    import yaml

    try:
        config = yaml.safe_load(run_dir.config_path.read_text(encoding="utf-8")) or {}
        return int(config["checkpoint"]["interval_steps"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None


def logs_present(data: RunData, t: dict[str, Any]) -> Criterion:
    name, source = "logs recorded and growing", "hosts/*/launcher.log, metrics.jsonl"
    max_age = t["log_max_age_s"]
    threshold = f"present; newest <= {max_age:g} s old while running"
    logs = sorted((data.run_dir.path / "hosts").glob("*/launcher.log"))
    metrics = data.run_dir.metrics_path
    missing = [p.parent.name for p in logs if p.stat().st_size == 0]
    if not logs or not metrics.exists():
        what = "no launcher log" if not logs else "no metrics.jsonl"
        return Criterion(name, threshold, what, FAIL if data.events else NO_DATA, source, what)
    state = data.run_dir.state()
    age = time.time() - max(p.stat().st_mtime for p in [*logs, metrics])
    measured = f"{len(logs)} host logs, newest {age:.0f} s old"
    stale = state is not None and state.active and age > max_age
    reason = ("empty: " + ", ".join(missing)) if missing else ("stale" if stale else "")
    return Criterion(
        name, threshold, measured, FAIL if missing or stale else PASS, source, reason,
        value=age, unit="s since the newest log line", limit=max_age,
    )  # fmt: skip


def nonfinite_steps(data: RunData, t: dict[str, Any]) -> Criterion:
    name, source = "non-finite steps", "events.jsonl nonfinite"
    limit = t["max_nonfinite_steps"]
    if not data.train:
        return _no_metrics(name, f"<= {limit}")
    count = sum(1 for e in data.events if e.get("event") == EventKind.NONFINITE)
    return Criterion(
        name, f"<= {limit}", f"{count} steps", PASS if count <= limit else FAIL, source,
        value=count, unit="steps", limit=limit,
    )  # fmt: skip


def goodput_share(data: RunData, t: dict[str, Any]) -> Criterion:
    from rlmctl import goodput

    threshold, measured, verdict, reason = goodput.criterion(data.run_dir, t)
    source = "events.jsonl, metrics.jsonl (runcontract.goodput)"
    return Criterion("goodput", threshold, measured, verdict, source, reason)


RUN_DIR_CRITERIA: tuple[Callable[[RunData, dict[str, Any]], Criterion], ...] = (
    tflops_per_gpu,
    loss_falling,
    val_ppl_falling,
    ppl_falls_with_depth,
    grad_norm_stable,
    lr_smooth,
    checkpoints_ok,
    logs_present,
    nonfinite_steps,
    goodput_share,
)


# -- Prometheus --------------------------------------------------------------------------------
class PrometheusError(Exception):
    pass


@dataclass(frozen=True)
class PrometheusAPI:
    """Where Prometheus answers and how to reach it: rlm_prometheus_url, the CA its certificate
    is checked with (rlm_monitoring_tls_ca; None: the system's) and the basic auth login."""

    url: str
    ca_file: str | None = None
    username: str = ""
    password: str = field(default="", repr=False)

    def __str__(self) -> str:
        return self.url


def prometheus_api(host: Any) -> PrometheusAPI | None:
    """The Prometheus an inventory host names (clusterspec.inventory.Host), None without a URL."""
    if not host.prometheus_url:
        return None
    return PrometheusAPI(
        host.prometheus_url, host.monitoring_ca_file, host.monitoring_username,
        host.monitoring_password,
    )  # fmt: skip


def _api(
    api: str | PrometheusAPI, path: str, params: dict[str, str], timeout: float
) -> dict[str, Any]:
    """One GET of Prometheus' HTTP API; a PrometheusError names what went wrong."""
    api = api if isinstance(api, PrometheusAPI) else PrometheusAPI(api)
    url = api.url
    request = urllib.request.Request(url.rstrip("/") + path + "?" + urllib.parse.urlencode(params))
    if api.username:
        login = base64.b64encode(f"{api.username}:{api.password}".encode()).decode()
        request.add_header("Authorization", f"Basic {login}")
    try:
        context = ssl.create_default_context(cafile=api.ca_file) if api.ca_file else None
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            body = json.loads(response.read().decode())
    except urllib.error.HTTPError as error:  # Prometheus answers 400/422 with a JSON error
        if error.code == 401:
            raise PrometheusError(
                f"{url} refuses the login (HTTP 401): set rlm_monitoring_username and "
                "rlm_monitoring_password to a user of rlm_monitoring_basic_auth_users (the "
                "generated login is in rlm_monitoring_credentials_file)"
            ) from None
        try:
            body = json.loads(error.read().decode())
        except ValueError:
            body = {"error": f"HTTP {error.code}"}
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = error if isinstance(error, ssl.SSLError) else getattr(error, "reason", error)
        if isinstance(reason, ssl.SSLError):
            raise PrometheusError(
                f"{url}: TLS fails ({reason}): set rlm_monitoring_tls_ca to the CA of its "
                "certificate"
            ) from None
        raise PrometheusError(f"{url} does not answer ({reason})") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        failure = body.get("error", body) if isinstance(body, dict) else body
        raise PrometheusError(f"{url}: query failed: {failure}")
    return body["data"]


def prom_query(
    url: str | PrometheusAPI, query: str, at: float | None = None, timeout: float = 5.0
) -> list[dict[str, Any]]:
    """The result vector of an instant query (HTTP API /api/v1/query)."""
    params = {"query": query} | ({"time": f"{at:.3f}"} if at else {})
    return _api(url, "/api/v1/query", params, timeout)["result"]


def prom_range(
    url: str | PrometheusAPI, query: str, start: float, end: float, timeout: float = 5.0
) -> list[tuple[float, float]]:
    """(seconds from start, value) points of the first series of a range query."""
    step = max(1.0, (end - start) / 200)
    params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    result = _api(url, "/api/v1/query_range", params, timeout)["result"]
    return [(float(t) - start, float(v)) for t, v in result[0]["values"]] if result else []


# The report's Prometheus charts: name -> (y label, query, threshold key and its words).
PROMETHEUS_CHARTS = {
    "gpu-utilisation": (
        "GPU utilisation %", "100 * avg(rlm_gpu_utilization_ratio)",
        "gpu_util_min_pct", "go-live minimum",
    ),
    "network-share": (
        "network share of link %",
        "100 * max(rate(rlm_network_transmit_bytes_total[1m]) / rlm_network_speed_bytes)",
        "network_max_pct", "go-live maximum",
    ),
}  # fmt: skip


def prometheus_charts(
    url: str | PrometheusAPI | None, start: float, end: float, t: dict[str, Any]
) -> list[Chart]:
    """GPU utilisation and network share over the run, where Prometheus has them, each with its
    threshold."""
    out: list[Chart] = []
    if not url:
        return out
    for name, (label, query, key, words) in PROMETHEUS_CHARTS.items():
        try:
            points = prom_range(url, query, start, end)
        except PrometheusError:
            return out
        if points:
            limit = [Threshold(float(t[key]), f"{words} {t[key]:g}%")]
            out.append(
                Chart(name, label, "seconds since the run started", label, {label: points}, limit)
            )
    return out


def _scalar(result: list[dict[str, Any]]) -> float | None:
    values = [float(r["value"][1]) for r in result]
    values = [v for v in values if math.isfinite(v)]
    return values[0] if len(values) == 1 else (min(values) if values else None)


def prometheus_criteria(
    url: str | PrometheusAPI | None, run: str, window_s: float, t: dict[str, Any], cpu: bool
) -> list[Criterion]:
    """GPU utilisation, network share of the link, trainer memory slope, scrape freshness."""
    source = f"Prometheus {url}" if url else "Prometheus"
    names = ("GPU utilisation", "network share of link", "host memory slope", "scrape freshness")
    if not url:
        reason = "rlm_prometheus_url is not set"
        return [
            Criterion(n, "-", "-", NA, source, "CPU run: no GPU or RDMA link")
            if cpu and n in names[:2]
            else Criterion(n, "-", "-", NO_DATA, source, reason)
            for n in names
        ]
    window = f"{max(60, int(window_s))}s"
    util_min, net_max = t["gpu_util_min_pct"], t["network_max_pct"]
    slope_max, fresh_max = t["memory_slope_max_mb_per_h"], t["scrape_max_age_s"]
    checks = (
        (
            names[0], f">= {util_min:g}% (mean over the run)",
            f"100 * avg(avg_over_time(rlm_gpu_utilization_ratio[{window}]))",
            lambda v: v >= util_min, "{:.1f}%", "no rlm_gpu_utilization_ratio series",
            "%", util_min,
        ),
        (
            names[1], f"<= {net_max:g}% (peak 5m rate / link speed)",
            f"100 * max(max_over_time((rate(rlm_network_transmit_bytes_total[5m]) "
            f"/ rlm_network_speed_bytes)[{window}:1m]))",
            lambda v: v <= net_max, "{:.1f}%", "no network series with a known link speed",
            "%", net_max,
        ),
        (
            names[2], f"<= {slope_max:g} MB/h growth",
            f"sum(deriv(rlm_trainer_resident_memory_bytes[{window}])) * 3600 / 1e6",
            lambda v: v <= slope_max, "{:+.1f} MB/h", "no rlm_trainer_resident_memory_bytes series",
            "MB/h", slope_max,
        ),
        (
            names[3], f"every target up, last scrape <= {fresh_max:g} s ago",
            "max(time() - timestamp(up)) * min(up) + (1 - min(up)) * 1e9",
            lambda v: v <= fresh_max, "{:.1f} s", "no scrape targets",
            "s", fresh_max,
        ),
    )  # fmt: skip
    out = []
    for name, threshold, query, ok, shown, empty, unit, limit in checks:
        if cpu and name in names[:2]:
            out.append(Criterion(name, threshold, "-", NA, source, "CPU run: no GPU or RDMA link"))
            continue
        try:
            value = _scalar(prom_query(url, query))
        except PrometheusError as error:
            out.append(Criterion(name, threshold, "-", NO_DATA, source, str(error)))
            continue
        if value is None:
            out.append(Criterion(name, threshold, "-", NO_DATA, source, empty))
            continue
        down = value >= 1e9  # a target down: no age to report
        measured = "target down" if down else shown.format(value)
        verdict = PASS if ok(value) else FAIL
        number = None if down else value
        out.append(Criterion(name, threshold, measured, verdict, source, "", number, unit, limit))
    return out


# -- the last health report --------------------------------------------------------------------
def health_record(shared_dir: str) -> tuple[dict[str, Any] | None, str]:
    """The newest health report (plain or --deep: the topology) with the communication path of
    the newest --deep one, kept apart so that a plain health run never erases it; and where."""
    from rlmctl.health import last_report_path, read_last_report

    plain, deep = read_last_report(shared_dir), read_last_report(shared_dir, deep=True)
    source = f"{last_report_path(shared_dir)}, {last_report_path(shared_dir, deep=True).name}"
    reports = [r for r in (plain, deep) if r is not None]
    if not reports:
        return None, source
    newest = max(reports, key=lambda r: float(r.get("time", 0)))
    report = {key: value for key, value in newest.items() if key != "deep"}
    if deep is not None and "deep" in deep:
        report["deep"] = deep["deep"]
    return report, source


def health_criteria(report: dict[str, Any] | None, source: str) -> list[Criterion]:
    names = ("GPU topology", "communication path")
    if report is None:
        reason = "no health report yet: run `rlmctl health --deep`"
        return [Criterion(n, "-", "-", NO_DATA, source, reason) for n in names]
    age = f"{(time.time() - report.get('time', time.time())) / 3600:.1f} h old"
    topo = [
        (h["host"], c)
        for h in report.get("hosts", [])
        for c in h.get("checks", [])
        if c["name"] == "topology"
    ]
    out = []
    if not topo:
        out.append(Criterion(names[0], "-", "-", NO_DATA, source, "report has no topology check"))
    else:
        bad = [f"{h}: {c['detail']}" for h, c in topo if c["state"] == "CRIT"]
        skipped = all(c["detail"].startswith("skipped") for _, c in topo)
        verdict = FAIL if bad else (NA if skipped else PASS)
        measured = f"{len(topo)} hosts, {len(bad)} degraded ({age})"
        reason = "; ".join(bad[:3]) or ("no GPU on the hosts" if skipped else "")
        out.append(
            Criterion(
                names[0], "no degraded link", measured, verdict, source, reason,
                value=len(bad), unit="hosts with a degraded link", limit=0,
            )
        )  # fmt: skip
    deep = report.get("deep")
    if deep is None:
        reason = "no `rlmctl health --deep` record yet: run it"
        out.append(Criterion(names[1], "-", "-", NO_DATA, source, reason))
        return out
    paths = deep.get("comm_path") or {}
    problems = [p for p in deep.get("problems", []) if " via " in p or "NIC" in p]
    summary = "; ".join(f"{h}: {p['summary']}" for h, p in paths.items()) or "gloo (no NCCL log)"
    if problems:
        verdict = FAIL
    elif paths:
        verdict = PASS
    else:
        verdict = NA
    reason = "; ".join(problems[:3]) or ("CPU hosts: no NCCL transport" if not paths else "")
    count = len(problems) if paths or problems else None
    out.append(
        Criterion(
            names[1], "rlm_fabric", summary, verdict, source, reason,
            value=count, unit="host pairs off the fabric", limit=0,
        )
    )  # fmt: skip
    return out


def evaluate(
    run: str,
    run_dir: RunDir,
    t: dict[str, Any],
    prometheus_url: str | PrometheusAPI | None,
    health_report: dict[str, Any] | None,
    health_source: str,
) -> Verdict:
    data = RunData.load(run_dir)
    criteria = [criterion(data, t) for criterion in RUN_DIR_CRITERIA]
    cpu = data.start().get("device") == "cpu"
    started = data.events[0]["time"] if data.events else time.time()
    criteria += prometheus_criteria(prometheus_url, run, time.time() - started, t, cpu)
    criteria += health_criteria(health_report, health_source)
    from runcontract.goodput import goodput

    return Verdict(run, criteria, goodput=goodput(run_dir).to_dict())


# -- the report --------------------------------------------------------------------------------
MAX_DEPTH_CURVES = 6  # lines on the perplexity-against-depth chart, first and last pass included


def depth_curves(data: RunData) -> dict[str, list[tuple[float, float]]]:
    """Validation perplexity against depth, one curve per checkpoint (the validation passes at a
    checkpoint's step; every pass where none coincide), oldest first: whether extra depth pays
    more as training goes on."""
    passes = {
        int(r["step"]): {float(d): float(v) for d, v in ppl.items() if _number(v) is not None}
        for r in data.val
        if isinstance(r.get("step"), int) and isinstance(ppl := r.get("perplexity"), dict)
    }
    passes = {step: curve for step, curve in passes.items() if len(curve) >= 2}
    saved = {e.get("step") for e in data.events if e.get("event") == EventKind.CHECKPOINT}
    steps = sorted(passes.keys() & saved)
    if len(steps) < 2:
        steps = sorted(passes)
    if len(steps) > MAX_DEPTH_CURVES:
        last = len(steps) - 1
        picks = {round(i * last / (MAX_DEPTH_CURVES - 1)) for i in range(MAX_DEPTH_CURVES)}
        steps = [steps[i] for i in sorted(picks)]
    out = {}
    for step in steps:
        curve = sorted(passes[step].items())
        gain = curve[0][1] / curve[-1][1] if curve[-1][1] else math.inf
        out[f"step {step} (ppl d{curve[0][0]:g}/d{curve[-1][0]:g} = {gain:.2f})"] = curve
    return out


def charts(run_dir: RunDir, criteria: list[Criterion]) -> list[Chart]:
    """The report's charts from the run directory; a criterion's limit is its chart's threshold."""
    data = RunData.load(run_dir)
    limits = {c.name: c.limit for c in criteria if c.limit is not None}
    loss = [(r["tokens"], v) for r in data.train if (v := _number(r.get("loss"))) is not None]
    tflops = [(r["step"], v) for r in data.train if (v := _number(r.get("tflops"))) is not None]
    by_depth: dict[str, list[tuple[float, float]]] = {}
    tokens_at = {r["step"]: t for r in data.train if (t := _number(r.get("tokens"))) is not None}
    # A validation pass without a train record of its step (metrics.jsonl cut short): its tokens
    # from the run's tokens per step, never its step number on a token axis.
    last = [(r["step"], t) for r in data.train if r.get("step") and (t := _number(r.get("tokens")))]
    per_step = last[-1][1] / last[-1][0] if last else 0.0
    for record in data.val:
        step = record["step"]
        for depth, ppl in sorted((record.get("perplexity") or {}).items(), key=lambda i: int(i[0])):
            if _number(ppl) is not None and (tokens := tokens_at.get(step, step * per_step)):
                by_depth.setdefault(f"depth {depth}", []).append((tokens, ppl))
    tflops_limit = limits.get("TFLOPS per GPU")
    out = [
        Chart("loss", "training loss", "tokens", "loss", {"train loss": loss}),
        Chart(
            "val-perplexity", "validation perplexity per recurrence depth", "tokens",
            "validation perplexity", by_depth,
        ),
        Chart(
            "perplexity-by-depth", "validation perplexity against depth, one line per checkpoint",
            "recurrence depth (test time)", "validation perplexity", depth_curves(data),
            log2_x=True, ramp=True,
        ),
        Chart(
            "tflops", "model TFLOP/s per GPU", "step", "TFLOP/s", {"TFLOP/s per GPU": tflops},
            [Threshold(tflops_limit, f"go-live minimum {tflops_limit:g}")]
            if tflops_limit is not None
            else [],
        ),
    ]  # fmt: skip
    return [chart for chart in out if not chart.empty]


def write_report(verdict: Verdict, run_dir: RunDir, extra_charts: list[Chart]) -> Path:
    """<run_dir>/acceptance.md with the table and the charts (PNG or SVG files in acceptance/)."""
    directory = run_dir.path / PLOTS_DIR
    directory.mkdir(exist_ok=True)
    drawn = [render(chart, directory) for chart in charts(run_dir, verdict.criteria) + extra_charts]
    lines = [
        f"# Go-live acceptance: {verdict.run}",
        "",
        f"Generated by `rlmctl accept` at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}.",
        "",
        f"**Verdict: {'ACCEPTED' if verdict.accepted else 'NOT ACCEPTED'}**"
        + (f" (not checked: {', '.join(verdict.not_checked)})" if verdict.not_checked else ""),
        "",
        "| criterion | threshold | measured | verdict | source | note |",
        "|---|---|---|---|---|---|",
    ]
    for c in verdict.criteria:
        cells = [c.name, c.threshold, c.measured, c.verdict, c.source, c.reason]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    lines.append("")
    for path in drawn:
        lines += [f"![{path.stem}]({PLOTS_DIR}/{path.name})", ""]
    path = run_dir.path / REPORT_NAME
    path.write_text("\n".join(lines), encoding="utf-8")
    verdict.report = str(path)
    verdict.plots = [str(p) for p in drawn]
    return path


def run(
    name: str,
    run_dir: RunDir,
    prometheus_url: str | PrometheusAPI | None,
    overrides: Any,
    shared_dir: str,
) -> Verdict:
    """The verdict of run `name`, with its report written into the run directory."""
    from rlmctl.errors import RlmctlError

    if not isinstance(overrides, dict | type(None)):
        raise RlmctlError(f"rlm_accept_thresholds must be a mapping, got {overrides!r}")
    try:
        limits = thresholds(overrides)
    except ValueError as error:
        raise RlmctlError(f"{error}; fix it in the inventory") from None
    if not run_dir.path.is_dir():
        raise RlmctlError(f"run directory {run_dir.path} of {name} does not exist")
    report, source = health_record(shared_dir)
    verdict = evaluate(name, run_dir, limits, prometheus_url, report, source)
    events = RunData.load(run_dir).events
    started = events[0]["time"] if events else time.time() - 3600
    write_report(verdict, run_dir, prometheus_charts(prometheus_url, started, time.time(), limits))
    return verdict

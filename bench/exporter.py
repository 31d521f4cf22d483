"""rlm-exporter cost: scrape latency with 8 GPUs and a run directory, its CPU overhead, and the
alert latency from a fault in a run directory to the webhook.

The exporter runs as its own process, exactly as on a node, with stand-ins for nvidia-smi and
dmesg that print recorded output (tests/monitoring/fixtures): the figures are the exporter's own
cost, not the vendor tool's (real nvidia-smi takes 50-300 ms of CPU per call on 8 GPUs). The load
average is printed before and after: on a shared machine the tail latency is scheduling delay.

Alert latency: the Debian prometheus and prometheus-alertmanager binaries on loopback, the
shipped rules with `for` removed, scraping the same exporter every second, the shipped routing
delivering to a real HTTP webhook (as in tests/monitoring/test_e2e_rig.py). Each cycle marks a run
failed in its status.json (the fault) and times RunFailed's arrival at the webhook, then marks it
running again and times the resolved notification.

    .venv/bin/python bench/exporter.py [--scrapes 1000] [--alert-cycles 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from tests.monitoring.test_e2e_rig import (  # noqa: E402
    WebhookReceiver,
    render_alertmanager,
    render_rules,
)
from trainer.rundir import EventKind, RunDir, RunState, write_manifest  # noqa: E402

FIXTURES = ROOT / "tests" / "monitoring" / "fixtures"
STANDIN = ROOT / "tests" / "monitoring" / "nvidia_smi_standin.py"
REFRESH_INTERVAL_S = 1.0  # 10x faster than the default, so the background cost shows quickly
PROMETHEUS, ALERTMANAGER = "/usr/bin/prometheus", "/usr/bin/prometheus-alertmanager"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_tools(bin_dir: Path) -> None:
    bin_dir.mkdir()
    # nvidia-smi answers each grouped query from the fixture (tests/monitoring/nvidia_smi_standin.py).
    nvidia = (
        f"exec '{sys.executable}' '{STANDIN}' '{FIXTURES / 'nvidia-smi-8gpu.csv'}' "
        f"--full-query '{FIXTURES / 'nvidia-smi-q-8gpu.txt'}' "
        f"--nvlink '{FIXTURES / 'nvidia-smi-nvlink-e-8gpu.txt'}' -- \"$@\""
    )
    for name, command in (("nvidia-smi", nvidia), ("dmesg", f"cat '{FIXTURES / 'dmesg-xid.txt'}'")):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{command}\n")
        path.chmod(0o755)


def make_runs(root: Path, count: int = 3) -> None:
    for index in range(count):
        run = RunDir(root / f"run-{index}").create()
        for _ in range(2):
            run.append_event(EventKind.START)
        for step in (1000, 2000, 3000):
            path = run.checkpoint_path(step)
            path.mkdir()
            for shard in range(8):
                (path / f"model-{shard}.safetensors").write_bytes(b"x" * 4096)
            write_manifest(path, step)
        run.write_status(state=RunState.RUNNING, step=3100, checkpoint_interval_steps=1000)


def scrape(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def wait_until(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            result = condition()
        except OSError:
            result = None
        if result:
            return result
        time.sleep(0.05)
    raise TimeoutError(f"no {what} within {timeout_s:g} s")


def alert_latency(tmp: Path, exporter_port: int, run: RunDir, cycles: int) -> list[tuple]:
    """(fault -> firing, recovery -> resolved) seconds of RunFailed at the webhook, per cycle."""
    webhook = WebhookReceiver()
    prom_port, am_port = free_port(), free_port()
    am_config = render_alertmanager(tmp / "alertmanager.yml", webhook.url)
    config_dir = tmp / "prometheus"
    config_dir.mkdir()
    render_rules(config_dir / "rules")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules/*.yml"],
        "alerting": {
            "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
        },
        "scrape_configs": [
            {
                "job_name": "rlm-exporter",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{exporter_port}"], "labels": {"host": "bench"}}
                ],
            }
        ],
    }
    (config_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp / "daemons.log", "wb")  # noqa: SIM115 (closed with the daemons)
    daemons = [
        subprocess.Popen(
            [ALERTMANAGER, f"--config.file={am_config}", f"--storage.path={tmp / 'am'}",
             f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
            stdout=log, stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=log, stderr=subprocess.STDOUT,
        ),
    ]  # fmt: skip
    query = f"http://127.0.0.1:{prom_port}/api/v1/query?query=rlm%3Arun_active"
    figures = []
    try:
        wait_until(lambda: json.loads(scrape(query))["data"]["result"], 60, "Prometheus data")
        for _ in range(cycles):
            status = run.read_status()
            fault = time.monotonic()
            run.write_status(**{**status, "state": "failed", "updated": time.time()})
            wait_until(lambda f=fault: webhook.alerts("RunFailed", "firing", f), 60, "RunFailed")
            firing = webhook.alerts("RunFailed", "firing", fault)[0][0] - fault
            recovery = time.monotonic()
            run.write_status(**{**status, "updated": time.time()})
            wait_until(
                lambda r=recovery: webhook.alerts("RunFailed", "resolved", r), 60, "resolved"
            )
            resolved = webhook.alerts("RunFailed", "resolved", recovery)[0][0] - recovery
            figures.append((firing, resolved))
    finally:
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=20)
        log.close()
        webhook.server.shutdown()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=1000)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument(
        "--alert-cycles", type=int, default=3, help="fault/recovery cycles timed at the webhook"
    )
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    alerts: list[tuple] = []
    with tempfile.TemporaryDirectory(prefix="rlm-bench-exporter-") as tmp:
        tmp_path = Path(tmp)
        fake_tools(tmp_path / "bin")
        make_runs(tmp_path / "runs")
        port = free_port()
        env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
        command = [
            sys.executable, "-m", "monitoring.exporter", "--address", "127.0.0.1",
            "--port", str(port), "--run-root", str(tmp_path / "runs"),
            "--interval", str(REFRESH_INTERVAL_S),
        ]  # fmt: skip
        exporter = subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            deadline = time.monotonic() + 60
            while True:
                try:
                    body = scrape(url)
                    if b"rlm_gpu_temperature_celsius" in body and b"rlm_run_step" in body:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    print("exporter did not come up within 60 s", file=sys.stderr)
                    return 1
                time.sleep(0.1)
            process = psutil.Process(exporter.pid)
            series = sum(1 for line in body.decode().splitlines() if not line.startswith("#"))

            latencies = []
            cpu_before, wall_before = cpu_seconds(process), time.monotonic()
            for _ in range(args.scrapes):
                started = time.perf_counter()
                scrape(url)
                latencies.append((time.perf_counter() - started) * 1000)
            busy_cpu = cpu_seconds(process) - cpu_before
            busy_wall = time.monotonic() - wall_before

            cpu_before, wall_before = cpu_seconds(process), time.monotonic()
            time.sleep(args.idle_seconds)
            idle_cpu = cpu_seconds(process) - cpu_before
            idle_wall = time.monotonic() - wall_before
            load_after = os.getloadavg()[0]
            if args.alert_cycles and all(shutil.which(b) for b in (PROMETHEUS, ALERTMANAGER)):
                run = RunDir(tmp_path / "runs" / "run-0")
                alerts = alert_latency(tmp_path, port, run, args.alert_cycles)
        finally:
            exporter.terminate()
            exporter.wait(timeout=10)

    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    background_pct = 100 * idle_cpu / idle_wall
    print(
        f"load average (1 min)       {load_before:.1f} before, {load_after:.1f} after the scrapes"
    )
    print(f"series per scrape          {series} (8 GPUs, 3 runs x 3 checkpoints, processes, net)")
    print(f"scrapes                    {len(latencies)} back to back, one client")
    print(f"scrape latency p50         {statistics.median(latencies):.2f} ms")
    print(f"scrape latency p99         {p99:.2f} ms   (target <= 50 ms)")
    print(f"scrape latency max         {latencies[-1]:.2f} ms")
    print(f"CPU per scrape             {1000 * busy_cpu / len(latencies):.2f} ms")
    print(f"scrape phase CPU           {100 * busy_cpu / busy_wall:.1f} % of one core")
    print(
        f"background CPU, no scrapes {background_pct:.2f} % of one core at --interval "
        f"{REFRESH_INTERVAL_S:g} s (≈{background_pct * REFRESH_INTERVAL_S / 10:.2f} % at the "
        "default 10 s)"
    )
    print(
        "CPU overhead at 15 s scrapes and 10 s refresh: "
        f"≈{background_pct * REFRESH_INTERVAL_S / 10 + 100 * busy_cpu / len(latencies) / 15:.2f} "
        "% of one core"
    )
    if alerts:
        firing = sorted(a for a, _ in alerts)
        resolved = sorted(b for _, b in alerts)
        print(
            f"alert latency (RunFailed)  fault -> webhook firing {statistics.median(firing):.1f} s "
            f"median, {firing[-1]:.1f} s max; recovery -> resolved "
            f"{statistics.median(resolved):.1f} s median, {resolved[-1]:.1f} s max "
            f"({len(alerts)} cycles; 1 s refresh, scrape, evaluation, group_wait; no `for`)"
        )
    elif args.alert_cycles:
        print(
            "alert latency              skipped: needs /usr/bin/prometheus and prometheus-alertmanager"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""rlm-exporter cost: scrape latency with 8 GPUs and a run directory, and its CPU overhead.

The exporter runs as its own process, exactly as on a node, with stand-ins for nvidia-smi and
dmesg that print recorded output (tests/monitoring/fixtures): the figures are the exporter's own
cost, not the vendor tool's (real nvidia-smi takes 50-300 ms of CPU per call on 8 GPUs).

    .venv/bin/python bench/exporter.py [--scrapes 1000]
"""

from __future__ import annotations

import argparse
import os
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

from trainer.rundir import RunDir, write_manifest  # noqa: E402

FIXTURES = ROOT / "tests" / "monitoring" / "fixtures"
STANDIN = ROOT / "tests" / "monitoring" / "nvidia_smi_standin.py"
REFRESH_INTERVAL_S = 1.0  # 10x faster than the default, so the background cost shows quickly


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_tools(bin_dir: Path) -> None:
    bin_dir.mkdir()
    # nvidia-smi answers each grouped query from the fixture (tests/monitoring/nvidia_smi_standin.py).
    nvidia = f"exec '{sys.executable}' '{STANDIN}' '{FIXTURES / 'nvidia-smi-8gpu.csv'}' -- \"$@\""
    for name, command in (("nvidia-smi", nvidia), ("dmesg", f"cat '{FIXTURES / 'dmesg-xid.txt'}'")):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{command}\n")
        path.chmod(0o755)


def make_runs(root: Path, count: int = 3) -> None:
    for index in range(count):
        run = RunDir(root / f"run-{index}").create()
        for _ in range(2):
            run.append_event("start")
        for step in (1000, 2000, 3000):
            path = run.checkpoint_path(step)
            path.mkdir()
            for shard in range(8):
                (path / f"model-{shard}.safetensors").write_bytes(b"x" * 4096)
            write_manifest(path, step)
        run.write_status(state="running", step=3100, checkpoint_interval_steps=1000)


def scrape(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=1000)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    args = parser.parse_args()
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
        finally:
            exporter.terminate()
            exporter.wait(timeout=10)

    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    background_pct = 100 * idle_cpu / idle_wall
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
    return 0


if __name__ == "__main__":
    sys.exit(main())

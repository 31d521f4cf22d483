"""`rlmctl accept` against a real Prometheus (the Debian package, on loopback) scraping a real HTTP
target that serves the exporter's metric names; ~45 s on 2 cores."""

from __future__ import annotations

import http.server
import random
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlmctl import accept

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
pytestmark = pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="prometheus not installed")


class Target(http.server.BaseHTTPRequestHandler):
    """What rlm-exporter exports on a busy GPU host: 90 % utilisation, a 100 Gb/s NIC sending
    1 MB/s, a trainer with a constant resident size."""

    started = time.time()

    def do_GET(self) -> None:  # http.server's name
        sent = int((time.time() - self.started) * 1e6)
        body = (
            'rlm_gpu_utilization_ratio{gpu="0"} 0.9\n'
            'rlm_gpu_utilization_ratio{gpu="1"} 0.9\n'
            f'rlm_network_transmit_bytes_total{{device="ib0"}} {sent}\n'
            'rlm_network_speed_bytes{device="ib0"} 12500000000\n'
            'rlm_trainer_resident_memory_bytes{pid="42"} 2000000000\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _start_prometheus(tmp_path: Path, target_port: int) -> tuple[subprocess.Popen, str]:
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: rlm\n    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
    )
    for _ in range(5):  # a random port; another test may hold it: retry on collision
        port = random.randint(20000, 60000)
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while time.time() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(url + "/-/ready", timeout=1).close()
                return proc, url
            except OSError:
                time.sleep(0.2)
        stderr = proc.communicate(timeout=10)[1] if proc.poll() is not None else ""
        proc.kill()
        if "address already in use" not in stderr:
            raise RuntimeError("prometheus did not start: " + stderr[-500:])
    raise RuntimeError("no free port for prometheus")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Target)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proc, url = _start_prometheus(tmp_path_factory.mktemp("prom"), server.server_address[1])
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        server.shutdown()


def _wait_for_data(url: str) -> None:
    """Until every criterion's query has samples (rate/deriv need two scrapes)."""
    deadline = time.time() + 60
    while time.time() < deadline:
        criteria = accept.prometheus_criteria(url, "r", 60, accept.thresholds(None), cpu=False)
        if all(c.verdict != accept.NO_DATA for c in criteria):
            return
        time.sleep(0.5)
    raise AssertionError(f"no data from {url}: {[c.reason for c in criteria]}")


def test_accept_reads_a_real_prometheus(prometheus: str) -> None:
    _wait_for_data(prometheus)
    criteria = accept.prometheus_criteria(prometheus, "r", 60, accept.thresholds(None), False)
    by_name = {c.name: c for c in criteria}
    assert by_name["GPU utilisation"].verdict == accept.PASS
    assert by_name["GPU utilisation"].measured == "90.0%"
    assert by_name["network share of link"].verdict == accept.PASS
    assert by_name["host memory slope"].verdict == accept.PASS
    assert by_name["scrape freshness"].verdict == accept.PASS
    # The same data against stricter thresholds fails each criterion.
    strict = accept.thresholds(
        {
            "gpu_util_min_pct": 95,
            "network_max_pct": 0.0,
            "memory_slope_max_mb_per_h": -1,
            "scrape_max_age_s": 0,
        }
    )
    failing = accept.prometheus_criteria(prometheus, "r", 60, strict, False)
    assert [c.verdict for c in failing] == [accept.FAIL] * 4, failing
    # A CPU run: the GPU and RDMA criteria are marked N/A, not passed.
    cpu = accept.prometheus_criteria(prometheus, "r", 60, accept.thresholds(None), True)
    assert [c.verdict for c in cpu[:2]] == [accept.NA, accept.NA]


def test_a_query_without_series_is_no_data(prometheus: str) -> None:
    assert accept.prom_query(prometheus, "absent_metric_rlm") == []
    with pytest.raises(accept.PrometheusError, match="query failed"):
        accept.prom_query(prometheus, "rate(")


def test_report_plots_utilisation_and_network_from_prometheus(prometheus: str) -> None:
    _wait_for_data(prometheus)
    drawn = accept.prometheus_plots(prometheus, time.time() - 120, time.time())
    assert set(drawn) == {"gpu-utilisation.svg", "network-share.svg"}
    assert all(svg.startswith("<svg") and "polyline" in svg for svg in drawn.values())
    assert accept.prometheus_plots(None, 0, 1) == {}

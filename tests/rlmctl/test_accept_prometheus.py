"""`rlmctl accept` against real Prometheus servers (the Debian package, on loopback): one scraping a
real HTTP target that serves the exporter's metric names with values chosen per criterion, one
scraping the real rlm-exporter running inside the session rig's hosts (GPU readings from the
stand-in nvidia-smi of tests/monitoring/test_e2e_rig.py, each host's own eth0). Both start together
so their waits for data overlap; 30-50 s on 2 cores, of which the rig part ~3 s."""

from __future__ import annotations

import contextlib
import http.server
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from monitoring.exporter import DEFAULT_PORT
from rlmctl import accept
from rlmctl.charts import Chart
from tests.monitoring.conftest import FIXTURES
from tests.monitoring.test_e2e_rig import exporter_command, fake_nvidia_smi, start_in_node
from tests.rig import Rig

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


def _start_prometheus(tmp_path: Path, targets: list[str]) -> tuple[subprocess.Popen, str]:
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: rlm\n    static_configs: [{{targets: {targets}}}]\n"
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


@dataclass
class RigExporters:
    rig: Rig
    state: Path  # pid files and logs, on the shared directory

    def stop(self) -> None:
        """SIGTERM each process and wait for it to exit, so the next user of the session rig
        finds its ports free."""
        processes = []
        for pid_file in self.state.glob("*.pid"):
            with contextlib.suppress(ValueError, psutil.Error):
                processes.append(psutil.Process(int(pid_file.read_text())))
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(processes, timeout=20)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        shutil.rmtree(self.state.parent, ignore_errors=True)  # the session rig outlives us


def _start_rig_exporters(rig: Rig) -> RigExporters:
    """rlm-exporter in every rig host (stand-in nvidia-smi answering from the 8-GPU fixture) and
    a stand-in trainer worker on node1 (an idle python whose command line is the trainer's, so
    the exporter reports its constant resident size)."""
    base = rig.shared_dir / f"accept-{time.time_ns()}"
    state = base / "e2e"
    (base / "runs").mkdir(parents=True)
    state.mkdir()
    for host in rig.hosts:
        fake_nvidia_smi(state / f"bin-{host.name}", hot_gpu=None)
        start_in_node(rig, host.name, "rlm-exporter", exporter_command(base, host.name), state)
    idle = "import signal; signal.pause()"
    start_in_node(rig, "node1", "trainer", f"{sys.executable} -c '{idle}' -m trainer train", state)
    return RigExporters(rig, state)


@dataclass
class Servers:
    loopback: str  # Prometheus scraping the in-test Target
    rig: str | None  # Prometheus scraping the rig hosts' exporters; None without a rig
    rig_skip: str = ""


@pytest.fixture(scope="module")
def servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Target)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    procs: list[subprocess.Popen] = []
    exporters = None
    try:
        proc, loopback = _start_prometheus(
            tmp_path_factory.mktemp("prom"), [f"127.0.0.1:{server.server_address[1]}"]
        )
        procs.append(proc)
        rig_url, rig_skip = None, ""
        try:
            rig: Rig = request.getfixturevalue("rig")
        except pytest.skip.Exception as skipped:
            rig_skip = str(skipped)
        else:
            exporters = _start_rig_exporters(rig)
            targets = [f"{host.ip}:{DEFAULT_PORT}" for host in rig.hosts]
            proc, rig_url = _start_prometheus(tmp_path_factory.mktemp("rig-prom"), targets)
            procs.append(proc)
        yield Servers(loopback, rig_url, rig_skip)
    finally:
        if exporters is not None:
            exporters.stop()
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        server.shutdown()


@pytest.fixture(scope="module")
def prometheus(servers: Servers) -> str:
    return servers.loopback


def _wait_for_data(url: str) -> None:
    """Until every criterion's query has samples (rate/deriv need two scrapes). The network
    share is a `[..:1m]` subquery, evaluated at whole minutes: its first sample comes at the
    first whole minute after two scrapes, up to a minute plus the targets' start-up from now."""
    deadline = time.time() + 150
    while time.time() < deadline:
        criteria = accept.prometheus_criteria(url, "r", 60, accept.thresholds(None), cpu=False)
        if all(c.verdict != accept.NO_DATA for c in criteria):
            return
        time.sleep(0.5)
    raise AssertionError(f"no data from {url}: {[c.reason for c in criteria]}")


@pytest.mark.integration
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


@pytest.mark.integration  # waits for the network share's first whole minute: up to ~60 s
def test_report_plots_utilisation_and_network_from_prometheus(prometheus: str) -> None:
    _wait_for_data(prometheus)
    limits = accept.thresholds(None)

    def charts() -> list[Chart]:
        return accept.prometheus_charts(prometheus, time.time() - 120, time.time(), limits)

    def points(drawn: list[Chart]) -> list[int]:
        return [len(next(iter(c.series.values()))) for c in drawn]

    # The network share's rate has its first point at its second scrape, which can fall in the
    # range's last step when the criteria first have data (a full run failed so, with 1 point):
    # a line needs two.
    deadline = time.time() + 60
    while min(points(drawn := charts()), default=0) < 2 and time.time() < deadline:
        time.sleep(0.5)
    assert [c.name for c in drawn] == ["gpu-utilisation", "network-share"]
    assert min(points(drawn)) >= 2, points(drawn)
    assert [c.thresholds[0].value for c in drawn] == [80, 70]  # the go-live limits, drawn
    assert accept.prometheus_charts(None, 0, 1, limits) == []


def test_accept_reads_the_exporters_on_the_rig_hosts(servers: Servers) -> None:
    """The real exporter inside each rig host, scraped over the rig's bridge: GPU utilisation is
    the fixture's mean, the network share is each host's eth0 (a 10 Gb/s veth) and every target
    is fresh; stricter thresholds fail the same data."""
    if servers.rig is None:
        pytest.skip(servers.rig_skip)
    _wait_for_data(servers.rig)
    rows = (FIXTURES / "nvidia-smi-8gpu.csv").read_text().splitlines()
    mean_util = sum(float(row.split(", ")[2]) for row in rows) / len(rows)
    by_name = {c.name: c for c in accept.prometheus_criteria(
        servers.rig, "r", 60, accept.thresholds(None), cpu=False
    )}  # fmt: skip
    assert by_name["GPU utilisation"].verdict == accept.PASS
    assert by_name["GPU utilisation"].measured == f"{mean_util:.1f}%"
    assert by_name["network share of link"].verdict == accept.PASS
    assert by_name["scrape freshness"].verdict == accept.PASS, by_name["scrape freshness"]
    # Rig hosts share the machine's PID space: every trainer on the machine is counted, so only
    # that the slope was measured is certain here (its thresholds are tested above).
    assert by_name["host memory slope"].verdict in (accept.PASS, accept.FAIL)
    strict = accept.thresholds(
        {"gpu_util_min_pct": 100, "network_max_pct": 0.0, "scrape_max_age_s": 0}
    )
    failing = {c.name: c.verdict for c in accept.prometheus_criteria(
        servers.rig, "r", 60, strict, cpu=False
    )}  # fmt: skip
    assert failing["GPU utilisation"] == accept.FAIL
    assert failing["network share of link"] == accept.FAIL
    assert failing["scrape freshness"] == accept.FAIL

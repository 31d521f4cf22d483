"""Shared helpers for the monitoring tests: fake vendor tools on PATH and a scraped exporter."""

from __future__ import annotations

import contextlib
import os
import stat
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from monitoring import exporter

FIXTURES = Path(__file__).parent / "fixtures"


def install_tool(bin_dir: Path, name: str, script: str) -> Path:
    """A stand-in for a vendor binary: a shell script with the tool's name on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def printing(fixture: str, exit_code: int = 0) -> str:
    return f"cat '{FIXTURES / fixture}'\nexit {exit_code}"


# The nvidia-smi recordings (an 8× H100 80GB HBM3 node, driver 550.54.15) predate the last two
# query fields, `name` and `driver_version`; the stand-in appends those two columns to each GPU row.
RECORDED_NAME_COLUMNS = ", NVIDIA H100 80GB HBM3, 550.54.15"


def printing_nvidia(fixture: str, exit_code: int = 0) -> str:
    rows = f"sed -E '/^[0-9]/ s/$/{RECORDED_NAME_COLUMNS}/' '{FIXTURES / fixture}'"
    return f"{rows}\nexit {exit_code}"


@pytest.fixture
def tool_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def wait_for(
    condition: Callable[[], object],
    timeout_s: float = 20.0,
    what: str | Callable[[], str] = "",
    poll_s: float = 0.05,
) -> object:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`.

    A connection error counts as "not yet": servers under test may still be starting.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            result = condition()
            if result:
                return result
        if time.monotonic() > deadline:
            detail = what() if callable(what) else what or str(condition)
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {detail}")
        time.sleep(poll_s)


@pytest.fixture
def run_exporter() -> Iterator[Callable[..., int]]:
    """Start an in-process exporter on a free port of 127.0.0.1; returns the port."""
    started = []

    def start(*argv: str) -> int:
        args = exporter.parse_args(list(argv))
        collector = exporter.build_collector(args)
        server = exporter.serve(collector, "127.0.0.1", 0)
        started.append((server, collector))
        return server.server_port

    yield start
    for server, collector in started:
        server.shutdown()
        server.server_close()
        for source in collector.sources.values():
            source.stop()

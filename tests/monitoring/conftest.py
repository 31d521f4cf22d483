"""Shared helpers for the monitoring tests: fake vendor tools on PATH and a scraped exporter."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from monitoring import exporter
from tests.monitoring.nvidia_smi_standin import RECORDED_FIELDS

FIXTURES = Path(__file__).parent / "fixtures"
__all__ = ["RECORDED_FIELDS"]  # the columns of the nvidia-smi recordings


def install_tool(bin_dir: Path, name: str, script: str) -> Path:
    """A stand-in for a vendor binary: a shell script with the tool's name on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def printing(fixture: str, exit_code: int = 0) -> str:
    return f"cat '{FIXTURES / fixture}'\nexit {exit_code}"


STANDIN_NVIDIA_SMI = Path(__file__).parent / "nvidia_smi_standin.py"


def printing_nvidia(fixture: str, exit_code: int = 0, reject: tuple[str, ...] = ()) -> str:
    """nvidia-smi answering each --query-gpu from a recording (see nvidia_smi_standin.py), and
    `-q` and `nvlink -e` from the 8-GPU ones; `reject` names fields this stand-in's driver does
    not know."""
    options = [f"--exit {exit_code}", *(f"--reject {field}" for field in reject)]
    options += [
        f"--full-query '{FIXTURES / 'nvidia-smi-q-8gpu.txt'}'",
        f"--nvlink '{FIXTURES / 'nvidia-smi-nvlink-e-8gpu.txt'}'",
    ]
    return (
        f"exec '{sys.executable}' '{STANDIN_NVIDIA_SMI}' '{FIXTURES / fixture}' "
        f'{" ".join(options)} -- "$@"'
    )


@pytest.fixture
def tool_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu_drivers_loaded: Path) -> Path:
    """A directory for stand-in vendor tools, first on PATH, on a host whose GPU drivers count as
    loaded."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return parse(response.read().decode())


def parse(text: str) -> Samples:
    """The samples of an exposition (a scrape, `rlm-exporter --once`)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # An empty label is no label, as Prometheus stores it.
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if v))
            samples[(sample.name, labels)] = sample.value
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

"""Helpers for rlmctl tests: run the real CLI as a subprocess, write small inventories."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def rlmctl(*args: str, timeout: float = 120, env: dict[str, str] | None = None):
    """`python -m rlmctl ARGS` as an operator would run it; CompletedProcess with text output."""
    return subprocess.run(
        [sys.executable, "-m", "rlmctl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        check=False,
    )


T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str) -> T:
    """Poll `condition` until it is truthy (its value), failing naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.2)
    return value


def assert_one_line_error(result, exit_code: int, *fragments: str) -> None:
    """A user error: the given exit code, one `error:` line on stderr, no traceback."""
    assert result.returncode == exit_code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# rlmctl, run as root on a local controller, submits Slurm jobs as rlm_service_user through
# runuser (never as root): the tests' stand-in controller uses `nobody`, which every Linux has.
SUBMITTER = "nobody"


@pytest.fixture
def open_tmp_path() -> Iterator[Path]:
    """A temporary directory every user may use, outside pytest's base directory (0700, and set
    back to it whenever a pytest session starts): the submitter runs stand-ins of Slurm's
    commands from it and writes their logs in it."""
    path = Path(tempfile.mkdtemp(prefix="rlm-open-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def local_inventory(tmp_path: Path) -> Path:
    """This machine as a one-host cluster (local connection) with a private shared dir."""
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    (inventory / "hosts.yml").write_text(
        "all:\n"
        "  children:\n"
        "    compute:\n"
        "      hosts:\n"
        "        localhost:\n"
        "  vars:\n"
        "    ansible_connection: local\n"
        "    rlm_gpu_vendor: none\n"
        "    rlm_gpus_per_node: 2\n"
        '    rlm_shared_dir: "{{ inventory_dir }}/../shared"\n'
        f"    rlm_rdzv_port: {free_port()}\n",
        encoding="utf-8",
    )
    (tmp_path / "shared").mkdir()
    return inventory

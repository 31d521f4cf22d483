"""Suite-wide fixtures: the multi-host rig (tests/rig, docs/rig.md).

`rig`: one 3-host rig for the whole session; use it read-only (no stopping sshd, no mounts).
`make_rig(n)`: a private rig of n hosts for one test, free to break; torn down after the test.
Both use RLM_RIG_ID (default 0). Tests using them are marked `rig` automatically and skip, with
the reason, where root or namespaces are unavailable.

`make test` runs two pytest-xdist workers, one test file at a time each (`--dist loadfile`): the
slow rig modules spend much of their time waiting on daemons (Slurm's timeouts, systemd boots,
dpkg), which the other worker fills. Worker N gets rig id RLM_RIG_ID + N, so every worker's rigs
have names, subnets and state directories of their own (docs/rig.md), and the slowest modules are
handed out first so that neither worker is left with one at the end.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# ansible-core (loaded in-process by the rlmctl and monitoring tests) replaces sys.intern with a
# callable object when it is imported; torch._dynamo, which torch imports lazily (checkpointing,
# the FLOP counter, the meta device), then refuses to register a substitute for it. Outside the
# tests no process needs both (rlmctl loads ansible but no dynamo), so import dynamo first here.
import torch._dynamo  # noqa: F401

from clusterspec import vendors
from tests.ansible.playbook_run import run_playbook
from tests.rig import Rig
from tests.rig.layout import MAX_SLOTS, RIG_ID_ENV, rig_id_from_env
from tests.suite_cpu import TIMELINE_ENV

# Longest first, by their measured times (docs/rig.md, docs/provisioning.md); the rest keep their
# collection order.
SLOWEST_MODULES = (
    "tests/slurm/test_slurm_rig.py",
    "tests/ansible/test_site_systemd.py",
    "tests/ansible/test_version_bump.py",
    "tests/monitoring/test_e2e_rig.py",
    "tests/ansible/test_rig_apply.py",
)


def _give_this_worker_its_own_rig_id() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ... under xdist
    if worker.startswith("gw"):
        os.environ[RIG_ID_ENV] = str((rig_id_from_env() + int(worker[2:])) % 10)


_give_this_worker_its_own_rig_id()

RIG_FIXTURES = {"rig", "make_rig"}


@functools.cache
def rig_unavailable() -> str | None:
    """Why the rig cannot run here, or None."""
    if os.geteuid() != 0:
        return "the multi-host rig needs root (network namespaces, mounts)"
    for tool in ("ip", "unshare", "nsenter", "ssh", "ssh-keygen", "/usr/sbin/sshd"):
        if shutil.which(tool) is None:
            return f"the multi-host rig needs {tool} (apt-get install iproute2 openssh-server)"
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "--uts", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"namespaces are unavailable here: {probe.stderr.strip()}"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if RIG_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.rig)
        # A module that imports run_playbook runs playbooks (in its tests or its fixtures).
        if getattr(getattr(item, "module", None), "run_playbook", None) is run_playbook:
            item.add_marker(pytest.mark.playbook)

    def rank(item: pytest.Item) -> int:
        module = item.nodeid.partition("::")[0]
        return SLOWEST_MODULES.index(module) if module in SLOWEST_MODULES else len(SLOWEST_MODULES)

    items.sort(key=rank)  # stable: within a module and among the rest, collection order holds


def pytest_runtest_protocol(item: pytest.Item) -> None:
    """With RLM_TEST_TIMELINE=FILE (`make test-cpu`): one line per test, where it runs, when it
    starts: which worker process and test a process belongs to (tests/suite_cpu.py)."""
    if timeline := os.environ.get(TIMELINE_ENV):
        line = json.dumps({"pid": os.getpid(), "test": item.nodeid, "time": time.time()})
        with open(timeline, "a", encoding="utf-8") as out:  # one short append: atomic
            out.write(line + "\n")


@pytest.fixture(scope="session")
def rig() -> Iterator[Rig]:
    if reason := rig_unavailable():
        pytest.skip(reason)
    with Rig(3, slot=0) as session_rig:
        yield session_rig


@pytest.fixture
def make_rig() -> Iterator[Callable[[int], Rig]]:
    if reason := rig_unavailable():
        pytest.skip(reason)
    made: list[Rig] = []

    def make(count: int) -> Rig:
        # Slot 0 is the session rig's, the last one test_rig.py's CLI tests'; each private rig
        # gets its own slot (own names and subnet).
        if len(made) + 2 >= MAX_SLOTS:
            raise RuntimeError(f"at most {MAX_SLOTS - 2} private rigs at once")
        private = Rig(count, slot=len(made) + 1)
        made.append(private)
        return private.up()

    try:
        yield make
    finally:
        for private in reversed(made):
            private.down()


@pytest.fixture
def gpu_drivers_loaded(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> Path:
    """Every vendor's driver loaded, as far as `rlm_gpu_vendor: auto` can tell: a /sys/module of
    the test's own (vendors.SYS_MODULE). The kernel side of the stand-in tools tests put on PATH."""
    root = tmp_path_factory.mktemp("sys-module")
    for module in vendors.VENDORS.values():
        (root / module.KERNEL_MODULE).mkdir()
    monkeypatch.setattr(vendors, "SYS_MODULE", root)
    return root  # remove a vendor's directory to unload its driver

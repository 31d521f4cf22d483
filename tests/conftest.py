"""Suite-wide fixtures: the multi-host rig (tests/rig, docs/rig.md).

`rig`: one 3-host rig for the whole session; use it read-only (no stopping sshd, no mounts).
`make_rig(n)`: a private rig of n hosts for one test, free to break; torn down after the test.
Both use RLM_RIG_ID (default 0). Tests using them are marked `rig` automatically and skip, with
the reason, where root or namespaces are unavailable.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest

# ansible-core (loaded in-process by the rlmctl and monitoring tests) replaces sys.intern with a
# callable object when it is imported; torch._dynamo, which torch imports lazily (checkpointing,
# the FLOP counter, the meta device), then refuses to register a substitute for it. Outside the
# tests no process needs both (rlmctl loads ansible but no dynamo), so import dynamo first here.
import torch._dynamo  # noqa: F401

from tests.rig import Rig
from tests.rig.layout import MAX_SLOTS

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

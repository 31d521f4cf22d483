"""The backend interface: every rlm_scheduler choice is one module, rlmctl/backend_<name>.py,
whose `Backend` answers the interface's methods with its signatures; the inventory's
rlm_scheduler picks one of them, and backends never import each other or the lifecycle."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from clusterspec.inventory import SCHEDULERS
from rlmctl import lifecycle
from rlmctl.backend import Backend
from rlmctl.context import Context, Site
from rlmctl.errors import RlmctlError
from tests.rlmctl.conftest import assert_one_line_error, rlmctl
from tests.test_imports import graph

METHODS = [name for name in vars(Backend) if not name.startswith("_")]


@pytest.mark.parametrize("name", SCHEDULERS)
def test_each_scheduler_is_one_module_with_the_interfaces_methods(name: str) -> None:
    assert set(METHODS) >= {"placement", "admit", "start", "probe", "stop", "node_checks"}
    implementation = importlib.import_module(f"rlmctl.backend_{name}").Backend
    for method in METHODS:
        ours = inspect.signature(getattr(implementation, method))
        assert ours == inspect.signature(getattr(Backend, method)), (name, method)


def test_backends_import_neither_each_other_nor_the_lifecycle() -> None:
    edges = graph()
    backends = [f"rlmctl.backend_{name}" for name in SCHEDULERS]
    for backend in backends:
        assert not edges[backend] & {*backends, "rlmctl.lifecycle", "rlmctl.cli"}, backend


def write_hosts(inventory: Path, **schedulers: str) -> Path:
    lines = ["all:", "  children:", "    compute:", "      hosts:"]
    for host, scheduler in schedulers.items():
        lines += [f"        {host}:", f"          rlm_scheduler: {scheduler}"]
    lines += ["  vars:", "    ansible_connection: local", "    rlm_gpu_vendor: none"]
    inventory.mkdir(exist_ok=True)
    (inventory / "hosts.yml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return inventory


def backend_module(path: Path, limit: str | None = None) -> str:
    """The module of the backend picked for that selection; picking contacts no host and opens
    no registry."""
    with Context(Site(str(path), limit)) as ctx:
        backend = lifecycle.backend_for(ctx)
        assert ctx._fleet is None and ctx._registry is None
    return type(backend).__module__


def test_rlm_scheduler_picks_the_implementation(tmp_path: Path) -> None:
    assert backend_module(write_hosts(tmp_path / "a", n1="ssh")) == "rlmctl.backend_ssh"
    slurm = write_hosts(tmp_path / "b", n1="slurm", n2="slurm")
    assert backend_module(slurm) == "rlmctl.backend_slurm"


def test_a_selection_that_mixes_schedulers_is_refused(tmp_path: Path) -> None:
    mixed = write_hosts(tmp_path / "inv", n1="ssh", n2="slurm")
    with pytest.raises(RlmctlError, match="disagree on rlm_scheduler"):
        backend_module(mixed)
    assert backend_module(mixed, limit="n2") == "rlmctl.backend_slurm"
    result = rlmctl("-i", str(mixed), "status", "some-run")
    assert_one_line_error(result, 2, "disagree on rlm_scheduler", "once for the whole group")

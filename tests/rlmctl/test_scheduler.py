"""The scheduler interface: SSH and Slurm answer the same methods with the same signatures, and
the inventory's rlm_scheduler picks one of them."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from clusterspec import inventory as inventories
from rlmctl.errors import RlmctlError
from rlmctl.launch import SshScheduler
from rlmctl.scheduler import Scheduler, for_site
from rlmctl.scheduler_slurm import SlurmScheduler
from tests.rlmctl.conftest import assert_one_line_error, rlmctl

METHODS = [name for name in vars(Scheduler) if not name.startswith("_")]


@pytest.mark.parametrize("implementation", [SshScheduler, SlurmScheduler])
def test_each_scheduler_has_the_interfaces_methods_and_signatures(implementation: type) -> None:
    assert set(METHODS) >= {"launch", "status", "stop", "resume", "watch", "node_checks"}
    for name in METHODS:
        ours = inspect.signature(getattr(implementation, name))
        assert ours == inspect.signature(getattr(Scheduler, name)), (implementation, name)


class Selection:
    """A Site as the CLI's session is one: the inventory and its selected hosts."""

    def __init__(self, path: Path, limit: str | None = None) -> None:
        self._inventory = inventories.load(str(path))
        self.limit = limit

    def inventory(self):
        return self._inventory

    def hosts(self):
        return self._inventory.select(self.limit, None)

    def fleet(self, hosts=None):
        raise AssertionError("picking a scheduler contacts no host")

    def registry(self, readonly=False):
        raise AssertionError("picking a scheduler opens no registry")


def write_hosts(inventory: Path, **schedulers: str) -> Path:
    lines = ["all:", "  children:", "    compute:", "      hosts:"]
    for host, scheduler in schedulers.items():
        lines += [f"        {host}:", f"          rlm_scheduler: {scheduler}"]
    lines += ["  vars:", "    ansible_connection: local", "    rlm_gpu_vendor: none"]
    inventory.mkdir(exist_ok=True)
    (inventory / "hosts.yml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return inventory


def test_rlm_scheduler_picks_the_implementation(tmp_path: Path) -> None:
    assert isinstance(for_site(Selection(write_hosts(tmp_path / "a", n1="ssh"))), SshScheduler)
    slurm = write_hosts(tmp_path / "b", n1="slurm", n2="slurm")
    assert isinstance(for_site(Selection(slurm)), SlurmScheduler)


def test_a_selection_that_mixes_schedulers_is_refused(tmp_path: Path) -> None:
    mixed = write_hosts(tmp_path / "inv", n1="ssh", n2="slurm")
    with pytest.raises(RlmctlError, match="disagree on rlm_scheduler"):
        for_site(Selection(mixed))
    assert isinstance(for_site(Selection(mixed, limit="n2")), SlurmScheduler)
    result = rlmctl("-i", str(mixed), "status", "some-run")
    assert_one_line_error(result, 2, "disagree on rlm_scheduler", "once for the whole group")

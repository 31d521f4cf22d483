"""What one rlmctl command works with: the site it is pointed at (the global options), the
inventory, the selected hosts, the connections to hosts and the run registry.

Each is made on first use and kept for the rest of the command (one inventory parse, one SSH
connection per host, one registry connection); `close()` (or leaving `with`) closes them. The
lifecycle and the backends take a `Context` instead of threading `(fleet, inventory, registry)`
through every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clusterspec import inventory as inventories
from clusterspec.inventory import DEFAULT_INVENTORY, Host, Inventory
from rlmctl.errors import RlmctlError
from rlmctl.registry import Registry, registry_path
from rlmctl.remote import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_FORKS, DEFAULT_TIMEOUT_S, Fleet
from runcontract.rundir import RunDir


@dataclass(frozen=True)
class Site:
    """What the global options select: the inventory, a host pattern and how hard to push."""

    inventory_path: str = DEFAULT_INVENTORY
    limit: str | None = None
    exclude: str | None = None
    forks: int = DEFAULT_FORKS
    timeout: float = DEFAULT_TIMEOUT_S


def runs_root(hosts: list[Host]) -> Path:
    """<rlm_shared_dir>/runs of the hosts, which must agree on it."""
    roots = {h.shared_dir for h in hosts}
    if len(roots) > 1:
        raise RlmctlError(
            f"selected hosts disagree on rlm_shared_dir ({', '.join(sorted(roots))}); "
            "set it once for the whole group in the inventory"
        )
    return hosts[0].runs_dir


class Context:
    """`readonly`: a command that only looks (status, runs, logs): the registry is opened
    read-only and never created or migrated."""

    def __init__(
        self, site: Site, readonly: bool = False, inventory: Inventory | None = None
    ) -> None:
        self.site = site
        self.readonly = readonly
        self._inventory = inventory
        self._hosts: list[Host] | None = None
        self._fleet: Fleet | None = None
        self._registry: Registry | None = None

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        fleet, registry = self._fleet, self._registry
        self._fleet = self._registry = None
        if fleet is not None:
            fleet.close()
        if registry is not None:
            registry.close()

    @property
    def inventory(self) -> Inventory:
        if self._inventory is None:
            self._inventory = inventories.load(self.site.inventory_path)
        return self._inventory

    @property
    def hosts(self) -> list[Host]:
        """The selected hosts (--limit, --exclude), in inventory order."""
        if self._hosts is None:
            self._hosts = self.inventory.select(self.site.limit, self.site.exclude)
        return self._hosts

    @property
    def fleet(self) -> Fleet:
        """Connections to hosts; commands run on the selected hosts unless told others."""
        if self._fleet is None:
            # A short --timeout also shortens the connect timeout: down hosts cost no more.
            connect = max(1, min(DEFAULT_CONNECT_TIMEOUT_S, int(self.site.timeout)))
            self._fleet = Fleet(self.hosts, self.site.forks, self.site.timeout, connect)
        return self._fleet

    @property
    def runs_root(self) -> Path:
        return runs_root(self.hosts)

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = Registry(registry_path(self.runs_root), readonly=self.readonly)
        return self._registry

    def run(self, name: str) -> RunDir:
        """The run directory of an indexed run; RunNotFound (one line) when there is none."""
        return RunDir(self.registry.run(name)["run_dir"])

    def host(self, name: str) -> Host:
        return self.inventory.hosts[name]

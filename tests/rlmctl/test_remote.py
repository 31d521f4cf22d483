"""Per-host results of the fan-out over the local transport (the SSH one is covered on the rig)."""

from __future__ import annotations

from pathlib import Path

from clusterspec import inventory
from rlmctl.remote import Fleet


def test_a_command_past_its_timeout_is_a_failed_result_saying_so(local_inventory: Path) -> None:
    hosts = inventory.load(local_inventory).select()
    with Fleet(hosts, timeout=1) as fleet:
        (result,) = fleet.run("echo started; sleep 30")
    assert not result.ok and result.rc is None
    assert result.error == "timed out after 1 s; raise --timeout or check the host's load"
    assert 1 <= result.duration < 30


def test_connections_never_rewrite_the_shared_fabric_config() -> None:
    """Fabric's Connection assigned `inline_ssh_env` into the Config all connections share,
    which re-merged it from empty while other threads read it ("No attribute or config key found
    for 'gateway'" at 16 hosts in bench/fanout.py)."""
    import threading

    from fabric import Config

    from rlmctl.remote import _connection_class

    config = Config(lazy=True)
    errors: list[str] = []

    def make() -> None:
        for _ in range(50):
            try:
                _connection_class()("192.0.2.1", user="root", port=22, config=config)
            except Exception as error:
                errors.append(repr(error))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and config._modifications == {}

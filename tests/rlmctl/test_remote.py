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

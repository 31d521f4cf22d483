"""site.yml on bare systemd rig nodes (Debian 12, tests/rig/booted.py): wall time on 1 vs 8 nodes
(target: 8 within 1.5x of 1) and the idempotent rerun. Applies everything that can run without
GPUs, packages from the rig's local apt repository included (see docs/provisioning.md).

    sudo .venv/bin/python bench/provisioning.py   # 10-20 minutes; uses RLM_RIG_ID, slot 7
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ansible.playbook_run import run_playbook, write_inventory
from tests.ansible.systemd_site import build_offline_stacks, site_inventory
from tests.rig import Rig

SLOT = 7


def timed_site(hosts: int, work: Path) -> tuple[float, float]:
    """(first run, rerun) wall seconds of site.yml on a fresh rig of `hosts` bare nodes."""
    with Rig(hosts, slot=SLOT, release="bookworm") as rig:
        wheelhouse, stacks = build_offline_stacks(rig, work)
        inventory = write_inventory(
            work / f"hosts-{hosts}.yml", site_inventory(rig, wheelhouse, stacks)
        )
        times = []
        for attempt in ("first", "rerun"):
            start = time.monotonic()
            run = run_playbook("site.yml", inventory, work, timeout=3600)
            times.append(time.monotonic() - start)
            changed = sum(run.stats(h.name)["changed"] for h in rig.hosts)
            if run.rc != 0:
                failures = {h.name: run.failures(h.name) for h in rig.hosts}
                raise SystemExit(f"site.yml failed on {hosts} hosts ({attempt}): {failures}")
            print(f"  {hosts} host(s), {attempt:5s}: {times[-1]:6.1f} s, {changed} changed tasks")
        return times[0], times[1]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="rlm-bench-ansible-") as tmp:
        work = Path(tmp)
        print("site.yml on bare Debian 12 systemd nodes (no GPU roles apply):")
        one_first, one_rerun = timed_site(1, work)
        eight_first, eight_rerun = timed_site(8, work)
    print(f"site.yml 1 host:   {one_first:6.1f} s   idempotent rerun {one_rerun:6.1f} s")
    print(f"site.yml 8 hosts:  {eight_first:6.1f} s   idempotent rerun {eight_rerun:6.1f} s")
    ratio = eight_first / one_first
    print(
        f"8 hosts / 1 host:  {ratio:.2f}x (target <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""site.yml on the rig: wall time on 1 vs 8 hosts (target: 8 hosts within 1.5x of 1) and the
idempotent rerun. Applies everything that can run without GPUs (see docs/provisioning.md).

    sudo .venv/bin/python bench/ansible.py        # a few minutes; uses RLM_RIG_ID, slot 7
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ansible.playbook_run import run_playbook, write_inventory
from tests.ansible.rig_site import build_site_stack, build_wheelhouse, site_inventory
from tests.rig import Rig

SLOT = 7


def timed_site(hosts: int, work: Path, wheelhouse: Path) -> tuple[float, float]:
    """(first run, rerun) wall seconds of site.yml on a fresh rig of `hosts` hosts."""
    with Rig(hosts, slot=SLOT) as rig:
        inventory = write_inventory(
            work / f"hosts-{hosts}.yml",
            site_inventory(rig, wheelhouse, build_site_stack(rig.shared_dir)),
        )
        times = []
        for attempt in ("first", "rerun"):
            start = time.monotonic()
            run = run_playbook("site.yml", inventory, work)
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
        wheelhouse = build_wheelhouse(work / "wheelhouse")
        print("site.yml on rig hosts (no GPU roles apply; services without systemd):")
        one_first, one_rerun = timed_site(1, work, wheelhouse)
        eight_first, eight_rerun = timed_site(8, work, wheelhouse)
    print(f"site.yml 1 host:   {one_first:6.1f} s   idempotent rerun {one_rerun:6.1f} s")
    print(f"site.yml 8 hosts:  {eight_first:6.1f} s   idempotent rerun {eight_rerun:6.1f} s")
    ratio = eight_first / one_first
    print(
        f"8 hosts / 1 host:  {ratio:.2f}x (target <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

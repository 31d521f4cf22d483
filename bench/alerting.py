"""Fault -> page and recovery -> resolved times of the roles' own monitoring stack.

Three bare Debian 12 systemd nodes (tests/rig/booted.py: node1 mgmt, node2 a GPU host with a
stand-in nvidia-smi and the real kernel log, node3 compute) provisioned by site.yml, receivers
pointed at a webhook on this machine, every shipped duration divided by SCALE
(tests/monitoring/alerting_site.py), a tiny training run on node2; then the faults in turn, each
timed at the webhook. Prints one row per fault and the Watchdog's cadence.

    sudo .venv/bin/python bench/alerting.py   # ~25 min at load 20; RLM_RIG_ID, slot 4 (the Slurm
                                              # module's: not while it runs under that id)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ansible.playbook_run import run_playbook, write_inventory
from tests.ansible.systemd_site import build_offline_stacks, site_inventory
from tests.monitoring import alerting_site as site
from tests.rig import Rig

SLOT = 4
MGMT, GPU_HOST, QUIET_HOST = "node1", "node2", "node3"


def main() -> int:
    with (
        tempfile.TemporaryDirectory(prefix="rlm-bench-alerting-") as tmp,
        Rig(3, slot=SLOT, release="bookworm") as rig,
    ):
        work = Path(tmp)
        started = time.monotonic()
        wheelhouse, stacks = build_offline_stacks(rig, work)
        inventory = write_inventory(work / "hosts.yml", site_inventory(rig, wheelhouse, stacks))
        provisioned = run_playbook("site.yml", inventory, work, timeout=3600)
        if provisioned.rc != 0:
            failures = {h.name: provisioned.failures(h.name) for h in rig.hosts}
            raise SystemExit(f"site.yml failed: {failures}")
        print(f"site.yml on 3 nodes: {time.monotonic() - started:.0f} s")
        data = rig.shared_dir / "alerting-data"
        subprocess.run(
            [sys.executable, "-m", "trainer", "prepare", "--out", str(data)],
            check=True,
            capture_output=True,
        )
        ctx = site.prepare(rig, inventory, MGMT, GPU_HOST)
        try:
            if ctx.deployed.rc != 0:
                raise SystemExit(f"monitoring.yml failed: {ctx.deployed.failures(MGMT)}")
            ctx.hostproc = site.copy_hostproc(rig.shared_dir)
            ctx.trainer = site.start_trainer(rig, ctx.inventory, GPU_HOST, data, ctx.hostproc)
            timings = [
                site.xid_in_the_kernel_log(ctx),
                site.lost_gpu(ctx),
                site.stalled_trainer(ctx),
                site.failed_run(ctx),
                site.stopped_exporter(ctx, QUIET_HOST),
            ]
            gaps = site.watchdog_gaps(ctx, posts=8)
        finally:
            site.stop_trainer(ctx)
            ctx.webhook.close()
    print(
        f"\nEvery shipped duration / {site.SCALE} (Prometheus intervals >= "
        f"{site.MIN_INTERVAL_S:g} s, rlm-exporter every {site.EXPORTER_INTERVAL_S} s on the GPU "
        f"host); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"{'alert':22s} {'fault -> page':>14s} {'recovery -> resolved':>21s}")
    for timing in timings:
        resolved = f"{timing.resolved_s:.1f} s" if timing.resolved_s is not None else "-"
        print(f"{timing.alert:22s} {timing.page_s:12.1f} s {resolved:>21s}")
    period = 300 / site.SCALE
    off = [gap for gap in gaps if abs(gap - period) > 30 / site.SCALE]
    print(
        f"Watchdog: {len(gaps)} gaps, median {statistics.median(gaps):.2f} s, "
        f"{min(gaps):.2f}-{max(gaps):.2f} s (shipped 300 s / {site.SCALE} = {period:g} s); "
        f"{len(off)} off by more than the scaled 30 s: {', '.join(f'{g:.2f}' for g in off) or '-'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

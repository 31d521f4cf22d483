"""Wall time of `rlmctl health` on 1, 4, 16 and 64 rig hosts (real sshd, real SSH), directly
and through a login bastion (ProxyJump: one SSH connection to the bastion, a channel through it
per host).

Prints figures; asserts nothing. Needs root (the rig); uses RLM_RIG_ID (default 0), slot 9.
Target: 64 hosts within 1.5× the time of one host (the fan-out is parallel, so the time should be
set by the slowest host, not the sum). On a small shared machine every rig host runs on the same
few cores, so the 64-host figure also measures 64 concurrent Python check scripts on them.

    sudo RLM_RIG_ID=7 .venv/bin/python bench/fanout.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/fanout.py` puts only bench/ on the path

import yaml  # noqa: E402

from tests.rig import Rig  # noqa: E402

SIZES = (1, 4, 16, 64)
REPEATS = 3


def health_seconds(inventory: Path, hosts: int) -> tuple[float, float, str]:
    """(wall time of the CLI, slowest host's round trip, overall state) of one run."""
    started = time.perf_counter()
    limit = f"compute[0:{hosts - 1}]"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlmctl",
            "-i",
            str(inventory),
            "--limit",
            limit,
            "health",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    wall = time.perf_counter() - started
    report = json.loads(result.stdout)
    assert len(report["hosts"]) == hosts, result.stderr
    slowest = max(h["duration"] for h in report["hosts"])
    return wall, slowest, report["state"]


def ssh_fanout_seconds(inventory: Path, hosts: int) -> float:
    """The controller's share alone: connect to every host and run `true` (no check script)."""
    from rlmctl import inventory as inventory_module
    from rlmctl.remote import Fleet

    selected = inventory_module.load(inventory).select(f"compute[0:{hosts - 1}]")
    started = time.perf_counter()
    with Fleet(selected) as fleet:
        results = fleet.run("true")
    assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
    return time.perf_counter() - started


def bastion_inventory(rig: Rig) -> Path:
    """The rig's hosts but node1 as compute hosts reached through node1 (ProxyJump from an ssh
    configuration file, as a site behind a login node writes it)."""
    config = rig.state_dir / "bench-bastion-ssh_config"
    config.write_text(
        f"Include {rig.ssh_config_path}\nHost * !node1 !{rig.hosts[0].ip}\n  ProxyJump node1\n"
    )
    inventory = yaml.safe_load(rig.inventory_path.read_text())
    compute = inventory["all"]["children"]["compute"]["hosts"]
    del compute["node1"]
    for host in compute.values():
        host["ansible_ssh_common_args"] = f"-F {config}"
    path = rig.state_dir / "bench-bastion-inventory.yml"
    path.write_text(yaml.safe_dump(inventory))
    return path


def table(inventory: Path, title: str) -> dict[int, float]:
    print(title)
    header = f"{'hosts':>5} {'health wall s':>14} {'slowest host s':>15} {'ssh true s':>11}"
    print(header + f" {'state':>6}   (medians of {REPEATS})")
    walls = {}
    for size in SIZES:
        runs = [health_seconds(inventory, size) for _ in range(REPEATS)]
        walls[size] = statistics.median(r[0] for r in runs)
        slowest = statistics.median(r[1] for r in runs)
        ssh = statistics.median(ssh_fanout_seconds(inventory, size) for _ in range(3))
        print(f"{size:>5} {walls[size]:>14.2f} {slowest:>15.2f} {ssh:>11.2f} {runs[-1][2]:>6}")
    ratio = walls[max(SIZES)] / walls[1]
    verdict = "meets" if ratio <= 1.5 else "misses"
    print(f"64 hosts / 1 host = {ratio:.2f}× ({verdict} the 1.5× target)")
    return walls


def main() -> None:
    if os.geteuid() != 0:
        print("bench/fanout.py: skipped, the rig needs root")  # `make bench` goes on
        return
    with Rig(max(SIZES) + 1, slot=9) as rig:
        print(
            f"rig of {max(SIZES) + 1} hosts up; load {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} CPUs"
        )
        direct = table(rig.inventory_path, "direct SSH:")
        jumped = table(bastion_inventory(rig), "through a bastion (node1, ProxyJump):")
        print(
            "bastion / direct, health wall: "
            + ", ".join(f"{n} hosts {jumped[n] / direct[n]:.2f}×" for n in SIZES)
        )


if __name__ == "__main__":
    main()

"""Prometheus file_sd target files from the Ansible inventory: the inventory stays the one list.

    python -m monitoring.file_sd --inventory inventory/prod --out /etc/prometheus/targets

writes one `<job>.json` per scrape job of monitoring/prometheus/prometheus.yml, and one
`gpu-<job>.json` per GPU vendor exporter: prometheus.yml's single `gpu-exporter` job reads
`gpu-*.json`, and each target's `job` label (which Prometheus keeps over the job name) names the
vendor's exporter, so a new vendor needs no edit there. Every target carries `host` (the
inventory name); hosts in the inventory group `drained` also carry `drained="true"`, which keeps
NodeDown quiet while they are out for maintenance. Prometheus re-reads the files on change; no
reload needed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from clusterspec import vendors
from clusterspec.inventory import (
    DRAINED_GROUP,
    TRAINING_GROUP,
    Host,
    Inventory,
    InventoryError,
    load,
)
from monitoring.exporter import OneLineErrorParser
from runcontract.rundir import write_json_atomic

# job → (port, which hosts). Ports are the defaults of the exporters and of the trainer's
# metrics endpoint (rank 0 serves it, launched with metrics.port=9401).
# None: the host's rlm_exporter_port (clusterspec/variables.yml, the rlm_exporter role's port).
# Vendor exporters come from the vendor descriptions, on that vendor's compute hosts.
VENDOR_JOBS = {v.EXPORTER_JOB[0]: (v.EXPORTER_JOB[1], v.NAME) for v in vendors.VENDORS.values()}
JOBS: dict[str, tuple[int | None, str]] = {
    "node": (9100, "all"),
    "rlm-exporter": (None, "all"),
    **VENDOR_JOBS,
    "rlm-trainer": (9401, "compute"),
}


def target_file(job: str) -> str:
    """The file_sd file of `job`: vendor exporters share prometheus.yml's gpu-*.json pattern."""
    return f"gpu-{job}.json" if job in VENDOR_JOBS else f"{job}.json"


def _wanted(host: Host, which: str) -> bool:
    if which == "all":
        return True
    if which == "compute":
        return TRAINING_GROUP in host.groups
    return TRAINING_GROUP in host.groups and host.gpu_vendor == which


def target_groups(inventory: Inventory) -> dict[str, list[dict[str, Any]]]:
    """Per job, one file_sd target group per host, in inventory order."""
    drained = set(inventory.groups.get(DRAINED_GROUP, []))
    jobs: dict[str, list[dict[str, Any]]] = {}
    for job, (port, which) in JOBS.items():
        groups = []
        for host in inventory.hosts.values():
            if not _wanted(host, which):
                continue
            labels = {"host": host.name}
            if job in VENDOR_JOBS:
                labels["job"] = job
            if host.name in drained:
                labels["drained"] = "true"
            target = f"{host.address}:{port or host.exporter_port}"
            groups.append({"targets": [target], "labels": labels})
        jobs[job] = groups
    return jobs


def write_targets(jobs: dict[str, list[dict[str, Any]]], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for job, groups in jobs.items():
        # Atomic: Prometheus watches the directory and must never read half a file.
        path = out / target_file(job)
        write_json_atomic(path, groups)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m monitoring.file_sd", description=__doc__)
    parser.add_argument("--inventory", "-i", required=True, help="Ansible inventory source")
    parser.add_argument("--out", required=True, type=Path, help="directory for <job>.json files")
    args = parser.parse_args(argv)
    try:
        inventory = load(args.inventory)
        paths = write_targets(target_groups(inventory), args.out)
    except InventoryError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except OSError as error:
        print(
            f"error: cannot write {args.out}: {error.strerror}; pick a writable --out",
            file=sys.stderr,
        )
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

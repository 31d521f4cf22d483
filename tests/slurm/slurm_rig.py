"""A Slurm cluster on systemd rig nodes: 1 mgmt (slurmctld, slurmdbd, MariaDB) + 3 compute
(slurmd), set up by site.yml from the rig's local apt repository. Shared by tests/slurm/.

What the rig needs and a real site does not: nspawn mounts the cgroup v1 controllers read-only
in a node, so they are remounted read-write before slurmd starts (docs/rig.md, facts on Slurm in
nspawn nodes); the rig's cgroups are v1 + a cgroup2 mount, which Slurm's v2 plugin refuses
("Hybrid mode is not supported"), hence CgroupPlugin=cgroup/v1.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tests.ansible.playbook_run import REPO, run_playbook, write_inventory
from tests.ansible.systemd_site import build_offline_stacks, site_inventory
from tests.rig import Rig
from tests.trainer.faults import FAULTS_ENV, Faults
from trainer.hooks import HOOKS_ENV

SLOT = 4  # see docs/rig.md for the slots of each module
NODES = 4  # node1: mgmt (controller); node2..node4: compute
COMPUTE = ("node2", "node3", "node4")
# The plays Slurm jobs need: validation (always), the base system (apt lists, limits), the
# service user rlm (users_ssh: uid 2000 on every node, the rig's key; rlmctl submits the jobs as
# rlm and gives it the run directories), the trainer venv, Slurm. tests/ansible/test_site_systemd.py
# applies all of site.yml to the same kind of nodes; here common installs only a short package
# list to keep the module's time.
SITE_TAGS = "common,users_ssh,trainer_env,slurm"
SERVICE_USER, SERVICE_UID = "rlm", 2000  # rlm_service_user and users_ssh_service_uid's defaults
# The rerun covers the Slurm play (the others' reruns are test_site_systemd's); check mode runs
# common too, which refreshes a bare node's apt lists, as site.yml --check does.
SLURM_TAGS = "slurm"
CHECK_TAGS = "common,slurm"
# The nodes run the health check every slurm_health_interval (the role's 300 s, as a site would);
# the tests that wait on the periodic check shorten it to this while they run: every round runs
# rlmctl's host checks on each node (three Python starts), which cost the shared cores the whole
# module long at 20 s.
HEALTH_INTERVAL_S = 20
# SlurmdTimeout: a node that stops answering (a munge key that differs) is DOWN after this, not
# after Slurm's 300 s; slurmctld pings every third of it.
SLURMD_TIMEOUT_S = 30
# A partition over the same nodes whose jobs preempt those of `compute` (preempt/partition_prio,
# PreemptMode=REQUEUE); its GraceTime is the preempted trainer's time to checkpoint.
URGENT = "urgent"
PREEMPT_GRACE_S = 60
# The site's accounts and QOS, created by the role with sacctmgr (the rerun must change nothing).
ACCOUNT = "rlm-site"
QOS = "long"
# Every trainer of the module's jobs appends the sample positions it trains on to
# <run>/ledger-rank<r>.jsonl (the test hook of tests/trainer/faults.py). The jobs' workers import
# it from the shared directory, their working directory (`install_ledger_hooks`); the batch
# script exports rlm_comm_env to them.
LEDGER = asdict(Faults(ledger=True))
LEDGER_ENV = {HOOKS_ENV: "tests.trainer.faults:from_env", FAULTS_ENV: json.dumps(LEDGER)}
# The same with every step held back on rank 0 (two micro-batches of 0.35 s: at most ~1.4
# steps/s whatever the load), for a run that must not reach its end before a signal (the
# time-limit test).
PACED_ENV = {**LEDGER_ENV, FAULTS_ENV: json.dumps({**LEDGER, "slow_rank": 0, "slow_s": 0.35})}
HOOK_FILES = (
    "tests/__init__.py",
    "tests/trainer/__init__.py",
    "tests/trainer/faults.py",
    "tests/trainer/file_opens.py",
)


def remount_cgroups_writable(rig: Rig, host: str) -> None:
    rig.exec(
        host,
        "for c in /sys/fs/cgroup/*/; do c=${c%/}; case $c in */unified|*/systemd) continue;; esac; "
        'mountpoint -q "$c" && mount -o remount,bind,rw "$c"; done',
    )


def slurm_inventory(rig: Rig, work: Path) -> dict[str, Any]:
    wheelhouse, stacks = build_offline_stacks(rig, work)
    inventory = site_inventory(rig, wheelhouse, stacks)
    inventory["all"]["vars"].update(
        {
            "rlm_scheduler": "slurm",
            "slurm_cgroup_plugin": "cgroup/v1",
            # Rig nodes have no GPU device files to confine.
            "slurm_constrain_devices": False,
            "common_packages": ["procps", "iproute2"],
            "common_time_sync": "none",
            "rlm_comm_env": LEDGER_ENV,
            "slurm_slurmd_timeout": SLURMD_TIMEOUT_S,
            "slurm_preemption": True,
            "slurm_preempt_grace_time": PREEMPT_GRACE_S,
            "slurm_partitions": [
                {"name": "compute", "group": "compute", "default": True},
                {"name": URGENT, "group": "compute", "priority_tier": 2},
            ],
            # As most shared sites: a job needs an association of its user with its account;
            # every launch of the module charges ACCOUNT (rlm_slurm_account).
            "slurm_accounting_enforce": ["associations"],
            "rlm_slurm_account": ACCOUNT,
            "slurm_qos": [{"name": QOS, "settings": {"MaxWall": "7-00:00:00"}}],
            "slurm_accounts": [
                {"name": ACCOUNT, "users": ["rlm"], "qos": ["normal", QOS], "default_qos": "normal"}
            ],
        }
    )
    return inventory


def prepare_corpus(rig: Rig, repo: Path) -> None:
    """The bundled corpus, tokenised for the jobs' short sequences, in the shared directory."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "prepare",
            "--out",
            str(rig.shared_dir / "data"),
            "--seq-len",
            "64",
        ],
        check=True,
        capture_output=True,
        cwd=repo,
    )


def install_ledger_hooks(rig: Rig, repo: Path) -> None:
    """The fault hooks the jobs' trainers import (LEDGER_ENV), into the shared directory."""
    for name in HOOK_FILES:
        target = rig.shared_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / name, target)


def provision(rig: Rig, work: Path, comm_env: dict[str, str] | None = None) -> Path:
    """The module's cluster for a benchmark (no check run, no rerun): cgroups made writable,
    site.yml's SITE_TAGS applied, the corpus prepared; the inventory's path. `comm_env` is the
    jobs' rlm_comm_env (None: no test hooks, the trainer as shipped)."""
    for host in rig.hosts[1:]:  # node1 is mgmt, the rest compute (the rig may have more)
        remount_cgroups_writable(rig, host.name)
    inventory = slurm_inventory(rig, work)
    inventory["all"]["vars"].pop("rlm_comm_env")
    if comm_env is not None:
        inventory["all"]["vars"]["rlm_comm_env"] = comm_env
    path = write_inventory(work / "slurm.yml", inventory)
    site = run_playbook("site.yml", path, work, tags=SITE_TAGS, timeout=1800)
    if site.rc != 0:
        raise SystemExit(f"site.yml failed: {site.stderr[-2000:]}")
    prepare_corpus(rig, REPO)
    return path

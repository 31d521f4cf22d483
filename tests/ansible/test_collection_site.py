"""site.yml from the installed rlm.ops collection (`ansible-playbook rlm.ops.site`), not from this
checkout: check mode with `--tags validate` on two local hosts, so that preflight and every role's
validation run from the installed copy, its plugins called by FQCN. Read-only, no rig."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.ansible.collection import install
from tests.ansible.playbook_run import FAKE_VENDOR_BIN, run_playbook, write_inventory

UBUNTU_NOBLE = {
    "rlm_os_family": "Debian",
    "rlm_distribution_release": "noble",
    "rlm_distribution_version": "24.04",
    "rlm_kernel": "6.8.0-49-generic",
}


def test_site_runs_from_the_installed_collection(tmp_path: Path) -> None:
    config = install(tmp_path / "collection")
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_host": "127.0.0.1",
        "rlm_gpu_power_limit_w": 500,
    }
    hosts = {"amd": {**local, "rlm_gpu_vendor": "amd"}, "nv": {**local, "rlm_gpu_vendor": "nvidia"}}
    inventory = {
        "all": {
            "children": {"mgmt": {"hosts": {"amd": None}}, "compute": {"hosts": hosts}},
            "vars": {
                **UBUNTU_NOBLE,
                "rlm_gpus_per_node": 8,
                "rlm_shared_fs": "none",
                "rlm_alert_allow_no_receiver": True,
            },
        }
    }
    run = run_playbook(
        "rlm.ops.site",
        write_inventory(tmp_path / "hosts.yml", inventory),
        tmp_path,
        check=True,
        skip_tags="reachability",
        tags="validate",
        env={
            "PATH": f"{FAKE_VENDOR_BIN}{os.pathsep}{os.environ['PATH']}",
            # Only the installed copy: no roles_path, no checkout on the collections path.
            "ANSIBLE_CONFIG": str(config),
        },
    )
    assert run.rc == 0, run.failures("amd") + run.failures("nv") + [run.stderr[-2000:]]
    # Preflight (reads clusterspec/variables.yml beside the playbooks) and the GPU roles'
    # validation (rlm.ops.rlm_vendor, rlm.ops.rlm_power_limits) ran on both hosts.
    for host, task in (
        ("amd", "Check ROCm supports this distribution and kernel"),
        ("nv", "Check the CUDA repository has this distribution"),
        ("amd", "Read power limits with the vendor tool"),
        ("nv", "Check the cap is inside every GPU's range before changing anything"),
    ):
        assert any(
            r.host == host and r.task.endswith(task) and not r.skipped for r in run.results
        ), (host, task)
    assert {r.play for r in run.results} >= {"Validate variables before any change"}
    assert all(run.changed(h) == [] for h in hosts)

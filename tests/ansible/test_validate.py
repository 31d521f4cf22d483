"""Bad variables stop provisioning in the preflight play, with one clear message per host, before
any task changes (or, in check mode, plans to change) anything on any host."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.ansible.playbook_run import FAKE_VENDOR_BIN, run_playbook, write_inventory

UBUNTU_NOBLE = {
    "rlm_os_family": "Debian",
    "rlm_distribution_release": "noble",
    "rlm_distribution_version": "24.04",
    "rlm_kernel": "6.8.0-49-generic",
}
BAD_HOSTS = {
    "bad_vendor": ({"rlm_gpu_vendor": "intel"}, "unknown GPU vendor rlm_gpu_vendor=intel"),
    "bad_rocm_kernel": (
        {"rlm_gpu_vendor": "amd", "rlm_kernel": "6.11.0-9-generic"},
        "unsupported ROCm/kernel pair: ROCm 6.2.4 on Ubuntu-noble with kernel 6.11.0-9-generic",
    ),
    "bad_lustre": (
        {"rlm_gpu_vendor": "nvidia", "rlm_shared_fs": "lustre", "rlm_lustre_mgs_nids": []},
        "missing Lustre MGS NID: set rlm_lustre_mgs_nids",
    ),
    "bad_cap": (
        {"rlm_gpu_vendor": "nvidia", "rlm_gpu_power_limit_w": "max"},
        "gpu_power_limit_w=max is not a number of watts",
    ),
}


def test_bad_variables_fail_before_any_change(tmp_path: Path) -> None:
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_host": "127.0.0.1",
    }
    hosts = {name: {**local, **host_vars} for name, (host_vars, _) in BAD_HOSTS.items()}
    hosts["good"] = {**local, "rlm_gpu_vendor": "amd"}
    inventory = {
        "all": {
            "children": {"mgmt": {"hosts": {"good": None}}, "compute": {"hosts": hosts}},
            "vars": {**UBUNTU_NOBLE, "rlm_gpus_per_node": 8, "rlm_shared_fs": "none"},
        }
    }
    run = run_playbook(
        "site.yml",
        write_inventory(tmp_path / "hosts.yml", inventory),
        tmp_path,
        check=True,
        env={"PATH": f"{FAKE_VENDOR_BIN}{os.pathsep}{os.environ['PATH']}"},
    )
    assert run.rc != 0
    for host, (_, message) in BAD_HOSTS.items():
        failures = run.failures(host)
        assert len(failures) == 1, (host, failures)
        assert message in failures[0], (host, failures)
    # The valid host is stopped too: a cluster is never provisioned on some nodes only.
    assert (
        "validation failed on bad_cap, bad_lustre, bad_rocm_kernel, bad_vendor"
        in (run.failures("good")[0])
    )
    every_host = [*BAD_HOSTS, "good"]
    assert all(run.changed(host) == [] for host in every_host), {
        h: run.changed(h) for h in every_host
    }
    assert {r.play for r in run.results} == {"Validate variables before any change"}

"""Bad variables stop provisioning in the preflight play, with one clear message per host, before
any task changes (or, in check mode, plans to change) anything on any host."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from tests.ansible.playbook_run import FAKE_VENDOR_BIN, REPO, run_playbook, write_inventory

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


def test_the_validate_tag_runs_the_checks_inside_every_gpu_role(tmp_path: Path) -> None:
    """`--tags validate` used to run only the include itself in gpu_amd, gpu_nvidia, gpu_power."""
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
            "vars": {**UBUNTU_NOBLE, "rlm_gpus_per_node": 8, "rlm_shared_fs": "none"},
        }
    }
    run = run_playbook(
        "provision.yml",
        write_inventory(tmp_path / "hosts.yml", inventory),
        tmp_path,
        check=True,
        tags="validate",
        env={"PATH": f"{FAKE_VENDOR_BIN}{os.pathsep}{os.environ['PATH']}"},
    )
    assert run.rc == 0, run.failures("amd") + run.failures("nv")
    gpu_play = "GPU driver stack, power caps and collectives"

    def ran_in_gpu_play(host: str, task: str) -> bool:
        return any(
            r.play == gpu_play and r.host == host and r.task.endswith(task) and not r.skipped
            for r in run.results
        )

    assert ran_in_gpu_play("amd", "Check ROCm supports this distribution and kernel")
    assert ran_in_gpu_play("nv", "Check the CUDA repository has this distribution")
    assert ran_in_gpu_play("amd", "Read power limits with the vendor tool")
    assert ran_in_gpu_play("nv", "Read power limits with the vendor tool")
    assert ran_in_gpu_play(
        "nv", "Check the cap is inside every GPU's range before changing anything"
    )
    assert all(run.changed(h) == [] for h in hosts)


def test_preflight_refuses_a_lockout_firewall_and_the_placeholder_key(tmp_path: Path) -> None:
    """The controller reaches nodes from 10.9.0.5 (the client end of SSH_CONNECTION, which a
    local connection inherits from this environment)."""
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_host": "127.0.0.1",
    }
    example = yaml.safe_load((REPO / "inventory/example/group_vars/all.yml").read_text())
    hosts = {
        "lockout": {**local, "firewall_ssh_sources": ["10.10.0.0/16", "192.168.1.7"]},
        "placeholder": {**local, "rlm_operator_keys": example["rlm_operator_keys"]},
        "good": {**local, "firewall_ssh_sources": ["10.10.0.0/16", "10.9.0.0/24"]},
    }
    inventory = {
        "all": {
            "children": {"mgmt": {"hosts": {"good": None}}, "compute": {"hosts": hosts}},
            "vars": {"rlm_gpu_vendor": "none", "rlm_gpus_per_node": 0, "rlm_shared_fs": "none"},
        }
    }
    run = run_playbook(
        "preflight.yml",
        write_inventory(tmp_path / "hosts.yml", inventory),
        tmp_path,
        check=True,
        env={"SSH_CONNECTION": "10.9.0.5 50000 127.0.0.1 22"},
    )
    assert run.rc != 0
    [lockout] = run.failures("lockout")
    assert (
        "firewall_ssh_sources=10.10.0.0/16,192.168.1.7 excludes the controller's address" in lockout
    )
    assert "10.9.0.5 on lockout: add it (e.g. 10.9.0.5/32)" in lockout
    [placeholder] = run.failures("placeholder")
    assert "still holds the example inventory's placeholder key" in placeholder
    assert "validation failed on lockout, placeholder" in run.failures("good")[0]

"""Check mode of the GPU, power, collectives and Lustre roles against this machine (read-only).

One playbook run plans five differently configured nodes at once (all `ansible_connection=local`):
AMD MI300X on Ubuntu jammy, NVIDIA H100 on EL 9 and on Ubuntu (vendor auto-detected from lspci),
two nodes whose "driver" package is a real Debian package that is absent (`hello`) or installed
(`procps`) so that apt itself decides whether the driver changes. (A cap the GPUs cannot take is
refused earlier, by preflight: test_validate.py.) This machine has no GPU driver loaded: nodes
whose driver is meant to be loaded look for a module that is (`/sys/module/kernel`),
amd_driver_new for the real amdgpu one. Vendor binaries are stand-ins printing recorded output
(fixtures/bin); the OS is faked through the rlm_os_family/... variables the roles read.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.ansible.playbook_run import (
    FAKE_VENDOR_BIN,
    REPO,
    PlaybookRun,
    run_playbook,
    write_inventory,
)

KEY = str(Path(__file__).parent / "fixtures" / "repo-signing-key.asc")
UBUNTU = {
    "rlm_os_family": "Debian",
    "rlm_distribution_release": "jammy",
    "rlm_distribution_version": "22.04",
    "rlm_kernel": "5.15.0-125-generic",
}
EL9 = {
    "rlm_os_family": "RedHat",
    "rlm_distribution_version": "9.4",
    "rlm_kernel": "5.14.0-427.13.1.el9_4.x86_64",
}
LOADED = {"gpu_detect_module_dirs": {"amd": "/sys/module/kernel", "nvidia": "/sys/module/kernel"}}
AMD = {**UBUNTU, **LOADED, "rlm_gpu_vendor": "amd", "gpu_amd_repo_key_src": KEY}
HOSTS = {
    "amd_plan": {**AMD, "rlm_gpu_power_limit_w": 600, "rlm_shared_fs": "lustre"},
    # Installed, not loaded: the real /sys/module/amdgpu is absent here.
    "amd_driver_new": {
        **AMD,
        "gpu_amd_driver_packages": ["hello"],
        "gpu_detect_module_dirs": {"amd": "/sys/module/amdgpu"},
        "rlm_gpu_power_limit_w": 600,
    },
    "amd_driver_current": {**AMD, "gpu_amd_driver_packages": ["procps"]},
    "nv_el9": {
        **EL9,
        **LOADED,
        "rlm_gpu_vendor": "nvidia",
        "gpu_nvidia_driver_version": "550.127.08",
        "rlm_gpu_power_limit_w": 500,
    },
    "nv_auto": {**UBUNTU, **LOADED, "rlm_gpu_vendor": "auto", "gpu_nvidia_repo_key_src": KEY},
}


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> PlaybookRun:
    work = tmp_path_factory.mktemp("check-mode")
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {
        "all": {
            "children": {
                "mgmt": {"hosts": {"amd_plan": None}},
                "compute": {
                    "hosts": {
                        name: {**local, "ansible_host": "127.0.0.1", **host_vars}
                        for name, host_vars in HOSTS.items()
                    }
                },
            },
            "vars": {
                "rlm_shared_fs": "none",
                "rlm_alert_allow_no_receiver": True,
                "rlm_gpus_per_node": 8,
                "rlm_lustre_mgs_nids": ["127.0.0.1@tcp"],
                "rlm_shared_dir": str(work / "lustre"),
                "rlm_comm_env": {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5"},
                # This Debian machine has no /etc/yum.repos.d for the EL hosts' repository files.
                "rlm_yum_reposdir": str(work),
            },
        }
    }
    # nv_auto detects its vendor and count from lspci: the inventory leaves the count unset.
    inventory["all"]["children"]["compute"]["hosts"]["nv_auto"]["rlm_gpus_per_node"] = ""
    return run_playbook(
        "provision.yml",
        write_inventory(work / "hosts.yml", inventory),
        work,
        check=True,
        skip_tags="reachability",
        tags="gpu,comm,lustre",
        env={
            "PATH": f"{FAKE_VENDOR_BIN}{os.pathsep}{os.environ['PATH']}",
            "FAKE_GPU_STATE_DIR": str(work / "gpu-state"),
        },
    )


def text(run: PlaybookRun, host: str, task: str) -> str:
    return json.dumps(run.task(host, task).result)


def module_names(run: PlaybookRun, host: str, task: str) -> list[str]:
    return run.task(host, task).result["invocation"]["module_args"]["name"]


def test_amd_repositories_are_pinned_to_the_rocm_release(planned: PlaybookRun) -> None:
    repos = text(planned, "amd_plan", "Add the amdgpu and ROCm repositories (deb822)")
    assert "URIs: https://repo.radeon.com/rocm/apt/6.2.4" in repos
    assert "URIs: https://repo.radeon.com/amdgpu/6.2.4/ubuntu" in repos
    assert "Suites: jammy" in repos and "Signed-By: /etc/apt/keyrings/rocm.asc" in repos
    pin = text(planned, "amd_plan", "Pin packages from the AMD repository host")
    assert "Pin: origin repo.radeon.com" in pin and "Pin-Priority: 600" in pin
    assert planned.task(
        "amd_plan", "Install the repository signing key from the controller"
    ).changed


def test_amd_packages_planned(planned: PlaybookRun) -> None:
    assert module_names(planned, "amd_plan", "Install the amdgpu kernel driver") == ["amdgpu-dkms"]
    assert module_names(planned, "amd_plan", "Install kernel headers for the running kernel") == [
        "linux-headers-5.15.0-125-generic",
        "linux-modules-extra-5.15.0-125-generic",
    ]
    runtime = module_names(planned, "amd_plan", "Install the ROCm runtime and RCCL")
    # hipcc and the RCCL headers: what building rccl-tests needs.
    assert {"rocm-hip-runtime", "rccl", "amd-smi-lib", "hipcc", "rccl-dev"} <= set(runtime)
    assert "render" in text(planned, "amd_plan", "Add GPU users to the render and video groups")


def test_a_driver_not_loaded_skips_its_users_with_one_line(planned: PlaybookRun) -> None:
    assert planned.task("amd_driver_new", "Install the amdgpu kernel driver").changed
    report = planned.task("amd_driver_new", "Report the pending reboot").result["msg"]
    assert report == (
        "amd_driver_new: reboot required (driver hello 6.2.4 installed, not loaded): "
        "run playbooks/reboot.yml"
    )
    # rlm_allow_reboot is false: the reboot handler is notified but does not reboot.
    assert not planned.ran("amd_driver_new", "Reboot to load the new amdgpu driver")
    # Nothing calls the vendor tools before the driver is loaded (they would fail).
    for task in ("List GPU agents with rocminfo", "Read power limits with the vendor tool"):
        assert not planned.ran("amd_driver_new", task), task
    assert planned.stats("amd_driver_new")["failures"] == 0
    assert not planned.task("amd_driver_current", "Install the amdgpu kernel driver").changed
    assert not planned.ran("amd_driver_current", "Report the pending reboot")


def test_amd_power_cap_planned_with_the_configured_value(planned: PlaybookRun) -> None:
    items = planned.task("amd_plan", "Set the power cap on GPUs that differ").result["results"]
    argvs = [item["invocation"]["module_args"]["argv"] for item in items]
    assert len(argvs) == 8
    assert all(argv[-2:] == ["--power-cap", "600"] for argv in argvs)
    assert "amd-smi set -g" in text(planned, "amd_plan", "Install the boot-time power cap script")


def test_nvidia_el9_driver_fabricmanager_and_nccl(planned: PlaybookRun) -> None:
    repo = planned.task("nv_el9", "Add the CUDA repository").result
    assert "developer.download.nvidia.com/compute/cuda/repos/rhel9/x86_64" in json.dumps(repo)
    # lspci shows four NVSwitches: fabricmanager is planned without being asked for.
    # dnf cannot run on this Debian machine: the plan is the package list the task was given.
    # NVIDIA signs its RHEL repositories with D42D0685 (3bf863cc is the Ubuntu key).
    assert "rhel9/x86_64/D42D0685.pub" in json.dumps(repo)
    # EPEL brings dkms (dnf cannot run here: planned, not resolved).
    assert planned.ran("nv_el9", "Install EPEL") and planned.ran("nv_el9", "Install dkms")
    driver = planned.task("nv_el9", "Decide the driver packages").result["ansible_facts"]
    assert driver["gpu_nvidia_driver_packages"] == [
        "@nvidia-driver:550-open",
        "nvidia-fabric-manager-550.127.08",
    ]
    items = planned.task("nv_el9", "Set the power cap on GPUs that differ").result["results"]
    assert [item["invocation"]["module_args"]["argv"][-2:] for item in items] == [
        ["-pl", "500"]
    ] * 8
    persistence = planned.task("nv_el9", "Enable persistence mode").result["results"]
    assert len(persistence) == 8


def test_nvidia_vendor_detected_from_lspci_on_ubuntu(planned: PlaybookRun) -> None:
    report = planned.task("nv_auto", "Report the detected GPUs").result["msg"]
    assert "vendor=nvidia count=8" in report and "nvswitch=4" in report
    assert module_names(planned, "nv_auto", "Install the NVIDIA driver") == [
        "nvidia-open-550",
        "nvidia-fabricmanager-550",
    ]
    # The CUDA compiler for nccl-tests comes from the toolkit release NCCL was built for.
    assert module_names(planned, "nv_auto", "Install NCCL") == [
        "libnccl2=2.21.5-1+cuda12.4",
        "libnccl-dev=2.21.5-1+cuda12.4",
        "cuda-nvcc-12-4",
    ]
    pin = text(planned, "nv_auto", "Pin the driver branch")
    assert "Pin: version 550.*" in pin
    assert "cuda/repos/ubuntu2204/x86_64/" in text(
        planned, "nv_auto", "Add the CUDA repository (deb822)"
    )


def test_comm_environment_and_lustre_mount_planned(planned: PlaybookRun) -> None:
    env = text(planned, "amd_plan", "Export the collective communication environment")
    assert "export NCCL_SOCKET_IFNAME=ib0" in env and "export NCCL_IB_HCA=mlx5" in env
    lnet = text(planned, "amd_plan", "Configure LNet")
    assert 'options lnet networks=\\"tcp(lo)\\"' in lnet
    mount = planned.task("amd_plan", "Mount the filesystem").result
    assert mount["changed"] and "_netdev" in mount["invocation"]["module_args"]["opts"]
    assert mount["invocation"]["module_args"]["src"] == "127.0.0.1@tcp:/lustre"


def test_no_unexpected_failures(planned: PlaybookRun) -> None:
    # Ignored failures are the package tasks check mode cannot resolve (repositories not written).
    for host in HOSTS:
        assert planned.stats(host)["failures"] == 0, (
            host,
            planned.failures(host),
        )


def test_the_boot_time_power_unit_of_a_site_copied_from_the_example_runs_as_root(
    tmp_path: Path,
) -> None:
    """The example sets rlm_service_user: rlm (the site's service account); the unit that sets
    power caps at boot must still run as root (only root can set caps)."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "inventory" / "example", site)
    host = {
        **UBUNTU,
        **LOADED,
        "ansible_connection": "local",
        "ansible_host": "127.0.0.1",
        "ansible_python_interpreter": sys.executable,
        "rlm_init_system": "systemd",
        # what a site replaces first: the placeholder key (preflight refuses it)
        "rlm_operator_keys": [
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAISiteKeySiteKeySiteKey ops@site"
        ],
    }
    compute = {"children": {"compute_nvidia": {"hosts": {"nv01": host}}}}
    mgmt = {"hosts": {"mgmt01": {**host, "rlm_gpu_vendor": "none"}}}
    hosts = {"all": {"children": {"mgmt": mgmt, "compute": compute}}}
    write_inventory(site / "hosts.yml", hosts)
    run = run_playbook(
        "provision.yml",
        site / "hosts.yml",
        tmp_path,
        check=True,
        skip_tags="reachability",
        tags="gpu_power",
        env={"PATH": f"{FAKE_VENDOR_BIN}{os.pathsep}{os.environ['PATH']}"},
    )
    assert run.failures("nv01") + run.failures("mgmt01") == []
    unit = run.task("nv01", "Install the systemd unit").result["diff"]
    after = "".join(d.get("after", "") for d in (unit if isinstance(unit, list) else [unit]))
    assert "ExecStart=/usr/local/sbin/rlm-gpu-power" in after
    assert "User=root" in after, after


def test_hosts_without_a_gpu_plan_the_gpu_and_comm_plays_without_vendor_facts(
    tmp_path: Path,
) -> None:
    """rlm_gpu_vendor: none has no vendor description: the roles that read one must not ask."""
    host = {
        **UBUNTU,
        "ansible_connection": "local",
        "ansible_host": "127.0.0.1",
        "ansible_python_interpreter": sys.executable,
        "rlm_gpu_vendor": "none",
        "rlm_shared_fs": "none",
        "rlm_alert_allow_no_receiver": True,
    }
    inventory = {
        "all": {"children": {"mgmt": {"hosts": {"m1": host}}, "compute": {"hosts": {"c1": host}}}}
    }
    run = run_playbook(
        "provision.yml",
        write_inventory(tmp_path / "hosts.yml", inventory),
        tmp_path,
        check=True,
        skip_tags="reachability",
        tags="gpu,comm,monitoring",
        env={"PATH": f"{FAKE_VENDOR_BIN}{os.pathsep}{os.environ['PATH']}"},
    )
    assert run.rc == 0 and run.failures("c1") == [], run.failures("c1")
    assert run.ran("c1", "Skip hosts without a GPU")

"""Bad input stops provisioning in the preflight play, with one clear message per host, before
any task changes (or, in check mode, plans to change) anything on any host: bad variables, an
unreachable host, an unsupported OS or kernel, a power cap outside the GPUs' range."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import yaml

from tests.ansible.collection import install
from tests.ansible.playbook_run import FAKE_VENDOR_BIN, REPO, run_playbook, write_inventory
from tests.ansible.rig_site import build_wheelhouse

UBUNTU_NOBLE = {
    "rlm_os_family": "Debian",
    "rlm_distribution_release": "noble",
    "rlm_distribution_version": "24.04",
    "rlm_kernel": "6.8.0-49-generic",
}
# The GPUs' driver counts as loaded where its module directory exists (here: /sys/module/kernel).
LOADED = {"gpu_detect_module_dirs": {"amd": "/sys/module/kernel", "nvidia": "/sys/module/kernel"}}
NO_GPU = {"rlm_gpu_vendor": "none"}
# These sites deploy Alertmanager with no receiver on purpose (preflight refuses it otherwise).
NO_ALERTS = {"rlm_alert_allow_no_receiver": True}
BAD_HOSTS = {
    "bad_vendor": ({"rlm_gpu_vendor": "intel"}, "unknown GPU vendor rlm_gpu_vendor=intel"),
    "bad_rocm_kernel": (
        {"rlm_gpu_vendor": "amd", "rlm_kernel": "6.11.0-9-generic"},
        "unsupported ROCm/kernel pair: ROCm 6.2.4 on Ubuntu-noble with kernel 6.11.0-9-generic",
    ),
    # The plugin of the vendor description's NET_PLUGIN, not the other vendor's.
    "bad_net_plugin": (
        {"rlm_gpu_vendor": "amd", "comm_net_plugin": "aws-ofi-nccl"},
        "comm_net_plugin=aws-ofi-nccl does not fit vendor amd: use aws-ofi-rccl (the vendor",
    ),
    "bad_lustre": (
        {"rlm_gpu_vendor": "nvidia", "rlm_shared_fs": "lustre", "rlm_lustre_mgs_nids": []},
        "missing Lustre MGS NID: set rlm_lustre_mgs_nids",
    ),
    "bad_cap": (
        {"rlm_gpu_vendor": "nvidia", "rlm_gpu_power_limit_w": "max"},
        "gpu_power_limit_w=max is not a number of watts",
    ),
    # The stand-in nvidia-smi reports H100s (200-700 W).
    "bad_cap_range": (
        {"rlm_gpu_vendor": "nvidia", "rlm_gpu_power_limit_w": 800, **LOADED},
        "power cap 800.0 W is outside the range of GPU 0, GPU 1, GPU 2, GPU 3, GPU 4, GPU 5, "
        "GPU 6, GPU 7 (200.0-700.0 W) on bad_cap_range: set gpu_power_limit_w "
        "(rlm_gpu_power_limit_w) inside that range",
    ),
    # Nothing listens on port 1 of loopback: the connection is refused (the reason is checked
    # in the test: ssh can exit before Ansible writes to it, and then only a broken pipe is known).
    "unreachable": (
        {**NO_GPU, "ansible_connection": "ssh", "ansible_port": 1, "ansible_user": "root"},
        "): check its ansible_host, ansible_port, ansible_user and SSH key",
    ),
    "old_os": (
        {**NO_GPU, "rlm_distribution_version": "20.04"},
        "unsupported OS on old_os: Debian 20.04 is not one of 12, 13, 22.04, 24.04"
        " (common_supported_versions): reinstall with a supported release",
    ),
    "old_kernel": (
        {**NO_GPU, "rlm_kernel": "4.15.0-213-generic"},
        "unsupported kernel on old_kernel: 4.15.0-213-generic is older than 4.18"
        " (common_min_kernel): boot a newer kernel",
    ),
    "misspelt": (
        {**NO_GPU, "rlm_gpus_per_nod": 4},
        "unknown variable rlm_gpus_per_nod on misspelt: not an rlm-ops variable"
        " (docs/variables.md lists them): did you mean rlm_gpus_per_node?",
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
            "vars": {**UBUNTU_NOBLE, "rlm_gpus_per_node": 8, "rlm_shared_fs": "none", **NO_ALERTS},
        }
    }
    run = run_playbook(
        "site.yml",
        write_inventory(tmp_path / "hosts.yml", inventory),
        tmp_path,
        check=True,
        skip_tags="reachability",
        env={"PATH": f"{FAKE_VENDOR_BIN}{os.pathsep}{os.environ['PATH']}"},
    )
    assert run.rc != 0
    for host, (_, message) in BAD_HOSTS.items():
        failures = run.failures(host)
        assert len(failures) == 1, (host, failures)
        assert message in failures[0], (host, failures)
    # What ssh said, or (a race seen in CI, where ssh exited before Ansible could send to it) why
    # ssh's own words are lost.
    assert re.search(
        r"unreachable is unreachable \((ssh: connect to host 127\.0\.0\.1 port 1: Connection refused"
        r"|the SSH connection closed before Ansible could use it \[Errno 32\] Broken pipe)\): check",
        run.failures("unreachable")[0],
    ), run.failures("unreachable")
    # The valid host is stopped too: a cluster is never provisioned on some nodes only.
    assert (
        f"validation failed on {', '.join(sorted(BAD_HOSTS))}: fix the variables reported above;"
        " nothing was changed on any host" in run.failures("good")[0]
    )
    every_host = [*BAD_HOSTS, "good"]
    assert all(run.changed(host) == [] for host in every_host), {
        h: run.changed(h) for h in every_host
    }
    assert {r.play for r in run.results} == {"Validate variables before any change"}


def test_the_validate_tag_runs_the_checks_inside_every_gpu_role(tmp_path: Path) -> None:
    """`--tags validate` used to run only the include itself in gpu_amd, gpu_nvidia, gpu_power.

    Run as a site runs the installed collection: `ansible-playbook rlm.ops.site`, with an
    ansible.cfg that knows only the copy `ansible-galaxy collection install --offline` put in
    place (no checkout, no roles_path), so preflight, the roles and their FQCN plugin calls all
    come from it.
    """
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
            "vars": {**UBUNTU_NOBLE, "rlm_gpus_per_node": 8, "rlm_shared_fs": "none", **NO_ALERTS},
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
            "ANSIBLE_CONFIG": str(config),
        },
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
    assert "Validate variables before any change" in {r.play for r in run.results}
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
            "vars": {
                "rlm_gpu_vendor": "none",
                "rlm_gpus_per_node": 0,
                "rlm_shared_fs": "none",
                **NO_ALERTS,
            },
        }
    }
    run = run_playbook(
        "preflight.yml",
        write_inventory(tmp_path / "hosts.yml", inventory),
        tmp_path,
        check=True,
        skip_tags="reachability",
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


def test_preflight_refuses_half_a_tls_setting_and_a_password_in_place_of_a_hash(
    tmp_path: Path,
) -> None:
    """The monitoring web settings (roles/monitoring_web) of mgmt hosts are checked before any
    change: a certificate without its key, a missing file, a clear password where a bcrypt hash
    belongs, a client login that is not one of the users."""
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_host": "127.0.0.1",
    }
    cert = tmp_path / "cert.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    hashed = "$2b$04$" + "a" * 53
    bad = {
        "half_tls": (
            {"rlm_monitoring_tls_cert": str(cert)},
            "rlm_monitoring_tls_cert and rlm_monitoring_tls_key must both be set (or neither)",
        ),
        "missing_key": (
            {"rlm_monitoring_tls_cert": str(cert), "rlm_monitoring_tls_key": "/nonexistent.key"},
            "missing: /nonexistent.key",
        ),
        "clear_password": (
            {
                "rlm_monitoring_basic_auth_users": {"ops": "hunter2"},
                "rlm_monitoring_username": "ops",
                "rlm_monitoring_password": "hunter2",
            },
            "not a hash: ops",
        ),
        "unknown_login": (
            {
                "rlm_monitoring_basic_auth_users": {"ops": hashed},
                "rlm_monitoring_username": "grafana",
                "rlm_monitoring_password": "x",
            },
            "must include rlm_monitoring_username (grafana) with rlm_monitoring_password set",
        ),
    }
    good = {
        **local,
        "rlm_monitoring_basic_auth_users": {"ops": hashed},
        "rlm_monitoring_username": "ops",
        "rlm_monitoring_password": "x",
    }
    hosts = {name: {**local, **host_vars} for name, (host_vars, _) in bad.items()} | {"good": good}
    inventory = {
        "all": {
            "children": {"mgmt": {"hosts": hosts}},
            "vars": {
                "rlm_gpu_vendor": "none",
                "rlm_gpus_per_node": 0,
                "rlm_shared_fs": "none",
                **NO_ALERTS,
            },
        }
    }
    run = run_playbook(
        "preflight.yml",
        write_inventory(tmp_path / "hosts.yml", inventory),
        tmp_path,
        check=True,
        skip_tags="reachability",
    )
    assert run.rc != 0
    for host, (_, message) in bad.items():
        [failure] = run.failures(host)
        assert message in failure, (host, failure)
        assert "hunter2" not in failure
    assert f"validation failed on {', '.join(sorted(bad))}" in run.failures("good")[0]


def test_preflight_names_each_source_a_node_cannot_reach(tmp_path: Path) -> None:
    """Before any change, each node tries what the roles will fetch: here a Python index and an
    AMD repository that refuse connections (nothing listens on port 9 of loopback), and an AMD
    mirror given as a `file:` tree that exists. One line per node names the source, why it
    failed and how to provide it (for the index: the wheelhouse builder's command)."""
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_host": "127.0.0.1",
    }
    refused = "http://127.0.0.1:9"
    mirror = tmp_path / "radeon"
    for tree in ("amdgpu/6.2.4/ubuntu", "rocm/apt/6.2.4"):
        (mirror / tree / "dists/noble").mkdir(parents=True)
        (mirror / tree / "dists/noble/Release").write_text("Suite: noble\n")
    key = Path(__file__).parent / "fixtures" / "repo-signing-key.asc"
    bundle_only = {
        "rlm_wheelhouse": str(build_wheelhouse(tmp_path / "wheelhouse")),
        "trainer_env_torch_source": "site",
        "trainer_env_site_dirs": [str(tmp_path)],
    }
    amd = {**bundle_only, "rlm_gpu_vendor": "amd", "gpu_amd_repo_key_src": str(key)}
    hosts = {
        "no_index": {
            **local,
            **NO_GPU,
            "trainer_env_torch_index_urls": {"none": f"{refused}/whl/cpu"},
        },
        "no_amd_mirror": {**local, **amd, "gpu_amd_repo_base": f"{refused}/radeon"},
        "good": {**local, **amd, "gpu_amd_repo_base": f"file://{mirror}"},
    }
    inventory = {
        "all": {
            "children": {"mgmt": {"hosts": {"good": None}}, "compute": {"hosts": hosts}},
            # The apt sources are this machine's: the systemd-node test tries a node's own.
            "vars": {**UBUNTU_NOBLE, "rlm_gpus_per_node": 8, "rlm_shared_fs": "none", **NO_ALERTS}
            | {"common_update_cache": False},
        }
    }
    run = run_playbook(
        "preflight.yml", write_inventory(tmp_path / "hosts.yml", inventory), tmp_path, check=True
    )
    assert run.rc != 0
    python = "{}.{}".format(*sys.version_info[:2])
    [no_index] = run.failures("no_index")
    assert (
        f"no_index cannot reach what site.yml installs from: Python index {refused}/whl/cpu/torch/"
        " (Connection refused): build a wheelhouse for this node on a connected machine "
        f"(`rlmctl wheelhouse --python {python} --vendor none --glibc " in no_index
    ), no_index
    assert "--out DIR`) and set rlm_wheelhouse=DIR for it" in no_index
    [no_mirror] = run.failures("no_amd_mirror")
    assert (
        f"no_amd_mirror cannot reach what site.yml installs from: AMD repository "
        f"{refused}/radeon/amdgpu/6.2.4/ubuntu/dists/noble/Release, "
        f"{refused}/radeon/rocm/apt/6.2.4/dists/noble/Release (Connection refused): mirror it "
        "(repo.radeon.com's layout) and set gpu_amd_repo_base to the mirror" in no_mirror
    ), no_mirror
    # The node with a reachable mirror and a wheelhouse is stopped only because the others failed.
    [good] = run.failures("good")
    assert "validation failed on no_amd_mirror, no_index" in good, good
    assert all(run.changed(h) == [] for h in hosts)

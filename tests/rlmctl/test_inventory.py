"""Inventory loading through ansible-core's API and Ansible-style host selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clusterspec import inventory
from clusterspec.inventory import InventoryError
from tests.rlmctl.conftest import assert_one_line_error, rlmctl

YAML = """
all:
  children:
    mgmt:
      hosts:
        head:
          ansible_host: 10.0.0.100
    compute:
      hosts:
        gpu1:
          ansible_host: 10.0.0.1
          ansible_port: 2201
        gpu2:
          ansible_host: 10.0.0.2
          rlm_gpus_per_node: 4
          ansible_python_interpreter: /usr/bin/python3.11
  vars:
    ansible_user: ops
    ansible_ssh_private_key_file: keys/id_ed25519
    ansible_ssh_common_args: "-o UserKnownHostsFile={{ inventory_dir }}/known_hosts -o StrictHostKeyChecking=yes"
    rlm_gpu_vendor: amd
    rlm_gpus_per_node: 8
    rlm_shared_dir: /lustre/rlm
    rlm_venv: /opt/rlm/venv
    rlm_comm_env:
      NCCL_SOCKET_IFNAME: ib0
      GLOO_SOCKET_IFNAME: eth0
"""

INI = """
[mgmt]
head ansible_host=10.0.0.100

[compute]
gpu[1:3] rlm_gpus_per_node=2

[compute:vars]
rlm_gpu_vendor=nvidia
ansible_user=train
"""


def test_yaml_inventory_resolves_connection_and_bundle_variables(tmp_path: Path) -> None:
    path = tmp_path / "hosts.yml"
    path.write_text(YAML)
    inv = inventory.load(path)
    hosts = {h.name: h for h in inv.select()}
    assert list(hosts) == ["gpu1", "gpu2"]  # default selection: the compute group
    gpu1, gpu2 = hosts["gpu1"], hosts["gpu2"]
    assert (gpu1.address, gpu1.port, gpu1.user) == ("10.0.0.1", 2201, "ops")
    assert gpu2.port == 22 and gpu2.gpus_per_node == 4 and gpu1.gpus_per_node == 8
    # What Ansible's ssh connection passes to `ssh` (the key relative to the inventory).
    assert gpu1.ssh_args[-10:] == (
        "-o",
        "Port=2201",
        "-o",
        f"IdentityFile={tmp_path / 'keys/id_ed25519'}",
        "-o",
        "User=ops",
        "-o",
        f"UserKnownHostsFile={tmp_path}/known_hosts",
        "-o",
        "StrictHostKeyChecking=yes",
    )
    assert gpu1.comm_env == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth0"}
    assert (gpu1.gpu_vendor, gpu1.shared_dir, gpu1.python) == (
        "amd",
        "/lustre/rlm",
        "/opt/rlm/venv/bin/python",
    )
    assert gpu1.groups == ("compute",)
    assert (gpu1.script_python, gpu2.script_python) == ("python3", "/usr/bin/python3.11")


def test_ini_inventory_with_ranges(tmp_path: Path) -> None:
    path = tmp_path / "hosts.ini"
    path.write_text(INI)
    hosts = inventory.load(path).select()
    assert [h.name for h in hosts] == ["gpu1", "gpu2", "gpu3"]
    assert {h.gpu_vendor for h in hosts} == {"nvidia"} and hosts[0].user == "train"
    assert hosts[0].address == "gpu1"  # no ansible_host: the inventory name


def test_directory_inventory_with_group_and_host_vars(tmp_path: Path) -> None:
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "host_vars").mkdir()
    (tmp_path / "hosts.ini").write_text("[compute]\nn1\nn2\n")
    (tmp_path / "group_vars" / "compute.yml").write_text(
        "rlm_gpus_per_node: 4\nansible_port: 2222\n"
    )
    (tmp_path / "host_vars" / "n2.yml").write_text("rlm_gpus_per_node: 2\n")
    hosts = {h.name: h for h in inventory.load(tmp_path).select()}
    assert hosts["n1"].gpus_per_node == 4 and hosts["n2"].gpus_per_node == 2
    assert hosts["n1"].port == hosts["n2"].port == 2222


def test_limit_and_exclude_use_ansible_patterns(tmp_path: Path) -> None:
    path = tmp_path / "hosts.ini"
    path.write_text(INI)
    inv = inventory.load(path)
    assert [h.name for h in inv.select(limit="compute[0:1]")] == ["gpu1", "gpu2"]
    assert [h.name for h in inv.select(limit="mgmt,gpu3")] == ["head", "gpu3"]
    assert [h.name for h in inv.select(limit="all:!mgmt")] == ["gpu1", "gpu2", "gpu3"]
    assert [h.name for h in inv.select(exclude="gpu2")] == ["gpu1", "gpu3"]
    assert [h.name for h in inv.select(limit="gpu*", exclude="gpu1,gpu3")] == ["gpu2"]
    with pytest.raises(InventoryError, match="gpu9"):
        inv.select(limit="gpu9")
    with pytest.raises(InventoryError, match="no hosts selected"):
        inv.select(exclude="compute")


def test_drained_hosts_auto_vendor_and_busbw_floor(tmp_path: Path) -> None:
    path = tmp_path / "hosts.yml"
    path.write_text(
        "all:\n  vars: {rlm_gpu_vendor: auto, rlm_comm_busbw_floor_gbps: 300}\n"
        "  children:\n"
        "    compute: {hosts: {n1: {}, n2: {}, n3: {}}}\n"
        "    drained: {hosts: {n2: {}}}\n"
    )
    inv = inventory.load(path)
    assert [h.name for h in inv.select()] == ["n1", "n3"]  # drained hosts are left out
    assert [h.name for h in inv.select(limit="n2")] == ["n2"]  # unless named explicitly
    host = inv.hosts["n1"]
    assert (host.gpu_vendor, host.busbw_floor_gbps) == ("auto", 300.0)
    path.write_text("all:\n  hosts: {n1: {rlm_gpu_vendor: intel}}\n")
    with pytest.raises(InventoryError, match="rlm_gpu_vendor must be one of"):
        inventory.load(path)


def test_cli_inventory_json_and_unknown_limit_host(tmp_path: Path) -> None:
    path = tmp_path / "hosts.yml"
    path.write_text(YAML)
    result = rlmctl("-i", str(path), "inventory", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [h["name"] for h in data["hosts"]] == ["gpu1", "gpu2"]
    assert data["groups"]["mgmt"] == ["head"]
    # global options may also follow the command
    result = rlmctl("inventory", "--limit", "nosuchhost", "-i", str(path))
    assert_one_line_error(result, 2, "nosuchhost")


def test_cli_bad_inventory_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(rlmctl("-i", str(tmp_path / "missing"), "inventory"), 2, "does not exist")
    broken = tmp_path / "broken.yml"
    broken.write_text("all:\n  hosts: [oops\n")
    assert_one_line_error(rlmctl("-i", str(broken), "inventory"), 2, "cannot load inventory")


def test_cli_usage_errors_exit_2_without_traceback() -> None:
    for args in (("nosuchcommand",), ("health", "--nosuchoption"), ()):
        result = rlmctl(*args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr


def test_cli_starts_without_heavy_imports() -> None:
    import subprocess
    import sys

    code = "import sys, rlmctl.cli; print(sorted(m for m in ('torch', 'ansible', 'fabric') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_host_defined_twice_is_refused_in_one_line(tmp_path: Path) -> None:
    """Reported: a host defined twice in one YAML mapping silently took the second definition
    (a duplicate key, which YAML loaders keep the last of)."""
    path = tmp_path / "hosts.yml"
    path.write_text(
        "all:\n  children:\n    compute:\n      hosts:\n"
        "        gpu01:\n          ansible_host: 10.0.0.1\n"
        "        gpu02:\n          ansible_host: 10.0.0.2\n"
        "        gpu01:\n          ansible_host: 10.0.0.3\n"
    )
    result = rlmctl("-i", str(path), "inventory")
    assert_one_line_error(result, 2, "gpu01", str(path))

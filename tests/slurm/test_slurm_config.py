"""The slurm role's configuration files as it renders them for GPU nodes, without a rig: the
role's own node description (roles/slurm/tasks/node.yml) and templates, run by ansible-playbook
on this machine against inventory hosts that stand for a 2-socket 8-GPU NVIDIA node, a
2-socket 8-GPU AMD node and this machine itself. Each GPU node's tools are stand-ins printing
recorded output (sources in the fixtures); the CPU-only host runs the real lscpu.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from plugins.filter.rlm_slurm import rlm_slurm_topology
from tests.ansible.playbook_run import REPO, run_playbook, write_inventory
from tests.slurm.test_binding import FIXTURES, ROCM_SMI_JSON, TOPOLOGY, recorded, x86_lscpu

PLAYBOOK = """
- name: Describe the compute nodes and render Slurm's files as the slurm role does
  hosts: all
  gather_facts: false
  environment:
    PATH: "{{ stand_ins }}:{{ lookup('ansible.builtin.env', 'PATH') }}"
  tasks:
    - name: Name the controller and compute nodes
      ansible.builtin.import_role: {name: slurm, tasks_from: validate.yml}
    - name: Describe each compute node
      ansible.builtin.include_role: {name: slurm, tasks_from: node.yml}
      when: slurm_is_compute
    - name: Render the files
      ansible.builtin.debug:
        msg: "{{ lookup('ansible.builtin.template', templates + '/' + item + '.j2') }}"
      loop: [slurm.conf, gres.conf, topology.conf, rlm-restart-settings]
      when: slurm_is_controller
"""


def stand_ins(directory: Path, outputs: dict[str, str]) -> str:
    """Commands that print a recorded output: {"nvidia-smi": text} answers every nvidia-smi call
    with text; {"rocm-smi --showproductname": text} only calls with that argument."""
    directory.mkdir(parents=True)
    by_tool: dict[str, list[tuple[str, Path]]] = {}
    for i, (call, text) in enumerate(outputs.items()):
        tool, _, argument = call.partition(" ")
        (directory / f"out{i}").write_text(text)
        by_tool.setdefault(tool, []).append((argument, directory / f"out{i}"))
    for tool, answers in by_tool.items():
        cases = "".join(f'  *"{arg}"*) exec cat {path} ;;\n' for arg, path in answers)
        script = directory / tool
        script.write_text(f'#!/bin/sh\ncase "$*" in\n{cases}esac\nexit 3\n')
        script.chmod(0o755)
    return str(directory)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    work = tmp_path_factory.mktemp("slurm-config")
    nvidia = stand_ins(
        work / "nvidia",
        {
            "lscpu": x86_lscpu(sockets=2, cores=56, threads=2),
            "nvidia-smi topo": recorded(TOPOLOGY / "nvidia-smi-topo-8x4090-nic-far-socket.txt"),
            "nvidia-smi --query-gpu=name": "NVIDIA GeForce RTX 4090\n" * 8,
        },
    )
    amd = stand_ins(
        work / "amd",
        {
            "lscpu": x86_lscpu(sockets=2, cores=64, threads=2),
            "rocm-smi --showtopo": recorded(FIXTURES / "rocm-smi-showtoponuma-8gpu-2numa.txt"),
            "rocm-smi --showproductname": ROCM_SMI_JSON.read_text(),
        },
    )
    # Named type, no Cores=: this node's GPU tools must not be called at all.
    named = stand_ins(work / "named", {"lscpu": x86_lscpu(sockets=2, cores=56, threads=2)})
    local = {"ansible_connection": "local", "ansible_python_interpreter": "/usr/bin/python3"}
    inventory = {
        "all": {
            "children": {
                "mgmt": {"hosts": {"ctl": None}},
                "compute": {
                    "children": {
                        "hgx": {
                            "hosts": {
                                "gpu1": {"stand_ins": nvidia},
                                "gpu2": {
                                    "stand_ins": named,
                                    "slurm_gres_cores": False,
                                    "slurm_gpu_type": "rtx4090",
                                },
                            },
                            "vars": {"rlm_gpu_vendor": "nvidia"},
                        },
                        "mi": {
                            "hosts": {"mi1": {"stand_ins": amd}},
                            "vars": {"rlm_gpu_vendor": "amd"},
                        },
                        "cpu": {"hosts": {"cpu1": {"stand_ins": str(work)}}},
                        # A vendor no description names: refused, never a node without GPUs.
                        "odd": {
                            "hosts": {"odd1": {"stand_ins": str(work)}},
                            "vars": {"rlm_gpu_vendor": "intel"},
                        },
                    }
                },
                "rack1": {"hosts": {"gpu1": None, "gpu2": None}},
                "rack2": {"hosts": {"mi1": None, "cpu1": None, "odd1": None}},
            },
            "vars": {
                **local,
                "stand_ins": str(work),
                "rlm_gpu_vendor": "none",
                "rlm_gpus_per_node": 8,
                "slurm_accounting_enforce": ["associations", "limits", "qos"],
                "slurm_switches": [
                    {"name": "leaf1", "group": "rack1"},
                    {"name": "leaf2", "group": "rack2"},
                    {"name": "spine", "switches": ["leaf1", "leaf2"]},
                ],
                "templates": str(REPO / "roles" / "slurm" / "templates"),
            },
        }
    }
    (work / "play.yml").write_text(PLAYBOOK)
    run = run_playbook(work / "play.yml", write_inventory(work / "inv.yml", inventory), work)
    assert [run.failures(h) for h in ("ctl", "gpu1", "gpu2", "mi1", "cpu1")] == [[]] * 5
    files = {r["item"]: r["msg"] for r in run.task("ctl", "Render the files").result["results"]}
    return {**files, "odd1": "\n".join(run.failures("odd1"))}


def lines_of(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_gres_conf_names_type_and_the_cores_near_each_gpu(rendered: dict[str, str]) -> None:
    assert lines_of(rendered["gres.conf"], "NodeName=") == [
        "NodeName=gpu1 Name=gpu Type=geforce_rtx_4090 File=/dev/nvidia[0-3] Cores=0-55",
        "NodeName=gpu1 Name=gpu Type=geforce_rtx_4090 File=/dev/nvidia[4-7] Cores=56-111",
        "NodeName=gpu2 Name=gpu Type=rtx4090 File=/dev/nvidia[0-7]",
        "NodeName=mi1 Name=gpu Type=mi250x File=/dev/dri/renderD[128-131] Cores=0-63",
        "NodeName=mi1 Name=gpu Type=mi250x File=/dev/dri/renderD[132-135] Cores=64-127",
    ]


def test_a_vendor_without_a_description_fails_in_one_line(rendered: dict[str, str]) -> None:
    """Not a node silently without GPUs: the GRES device files come from the descriptions."""
    assert rendered["odd1"].count("\n") == 0
    assert "GPU vendor intel is not one of" in rendered["odd1"]
    assert "NodeName=odd1" not in rendered["gres.conf"]


def test_slurm_conf_node_lines_come_from_each_nodes_own_cpus(rendered: dict[str, str]) -> None:
    nodes = {line.split()[0]: line for line in lines_of(rendered["slurm.conf"], "NodeName=")}
    assert "CPUs=224 Sockets=2 CoresPerSocket=56 ThreadsPerCore=2" in nodes["NodeName=gpu1"]
    assert nodes["NodeName=gpu1"].endswith(" Gres=gpu:geforce_rtx_4090:8 State=UNKNOWN")
    assert "CPUs=256 Sockets=2 CoresPerSocket=64 ThreadsPerCore=2" in nodes["NodeName=mi1"]
    assert " Gres=gpu:mi250x:8 " in nodes["NodeName=mi1"]
    # This machine, through the real lscpu: no GPUs, no Gres.
    assert "Gres=" not in nodes["NodeName=cpu1"]


def test_slurm_conf_site_settings(rendered: dict[str, str]) -> None:
    conf = rendered["slurm.conf"]
    assert lines_of(conf, "PropagateResourceLimitsExcept=") == [
        "PropagateResourceLimitsExcept=MEMLOCK"
    ]
    assert lines_of(conf, "AccountingStorageEnforce=") == [
        "AccountingStorageEnforce=associations,limits,qos"
    ]
    assert lines_of(conf, "AuthInfo=") == ["AuthInfo=cred_expire=60"]
    assert lines_of(conf, "TopologyPlugin=") == ["TopologyPlugin=topology/tree"]
    # Everything that only a restart applies is in the file whose change restarts the daemons.
    restart = rendered["rlm-restart-settings"]
    for setting in ("AccountingStorageEnforce=", "AuthInfo=", "TopologyPlugin="):
        assert lines_of(restart, setting) == lines_of(conf, setting)


def test_topology_conf_from_the_inventorys_switch_groups(rendered: dict[str, str]) -> None:
    assert lines_of(rendered["topology.conf"], "SwitchName=") == [
        "SwitchName=leaf1 Nodes=gpu1,gpu2",
        "SwitchName=leaf2 Nodes=mi1,cpu1,odd1",
        "SwitchName=spine Switches=leaf1,leaf2",
    ]


@pytest.mark.parametrize(
    ("switches", "says"),
    [
        ([{"name": "leaf1", "group": "rack1"}], "nodes mi1 are under no switch"),
        (
            [{"name": "leaf1", "group": "rack1"}, {"name": "leaf2", "group": "rack2"}],
            "switches leaf1, leaf2 have no common parent",
        ),
        ([{"name": "leaf1", "group": "rack9"}], "names the group rack9"),
        ([{"name": "spine", "switches": ["leaf7"]}], "switches leaf7 are not defined"),
    ],
)
def test_switches_that_leave_nodes_apart_are_refused(switches: list, says: str) -> None:
    groups = {"rack1": ["gpu1"], "rack2": ["mi1"]}
    with pytest.raises(AnsibleFilterError, match=says):
        rlm_slurm_topology(switches, groups, ["gpu1", "mi1"])


def test_the_role_documents_every_new_variable() -> None:
    defaults = yaml.safe_load((REPO / "roles/slurm/defaults/main.yml").read_text())
    specs = yaml.safe_load((REPO / "roles/slurm/meta/argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    assert set(defaults) == set(options)
    assert json.dumps(defaults["slurm_propagate_limits_except"]) == '["MEMLOCK"]'
    assert shutil.which("lscpu")

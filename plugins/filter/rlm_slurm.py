"""Filters of the slurm role over clusterspec/binding.py (the node's CPUs and the GPUs near them).

slurm_node_facts: "{{ slurm_lscpu.stdout | rlm_slurm_node(vendor, gpus, topology, names) }}"
argv: "{{ gpu_detect_vendor | rlm_binding_commands }}"      # lscpu, topology, names
lines: "{{ slurm_switches | rlm_slurm_topology(groups, compute_nodes) }}"
"""

from __future__ import annotations

import sys
from pathlib import Path

from ansible.errors import AnsibleFilterError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from clusterspec import binding
from clusterspec.vendors import VENDORS


def rlm_binding_commands(vendor: str) -> dict:
    """The commands whose output rlm_slurm_node reads: lscpu, and for a GPU vendor its topology
    command and GPU name query."""
    out = {"lscpu": list(binding.LSCPU)}
    if vendor in VENDORS:
        out["topology"] = list(VENDORS[vendor].TOPOLOGY.COMMAND)
        out["names"] = list(VENDORS[vendor].NAME_QUERY)
    return out


def rlm_slurm_node(
    lscpu: str,
    vendor: str,
    gpus: int,
    topology: str | None = None,
    names: str | None = None,
    gpu_type: str = "",
) -> dict:
    """clusterspec.binding.node_binding; topology None: not read (no Cores= in gres.conf), names
    None: not read (Type= only from gpu_type)."""
    try:
        return binding.node_binding(lscpu, vendor, int(gpus), topology, names, gpu_type or "")
    except binding.BindingError as error:
        raise AnsibleFilterError(str(error)) from None


def rlm_slurm_topology(switches: list, groups: dict, nodes: list) -> list[str]:
    """topology.conf lines: a leaf switch per {name, group} (the inventory group's hosts that
    are compute nodes), a switch over others per {name, switches}. Slurm places a job only on
    nodes under one switch, so every node must be under a leaf and every switch under one root."""
    lines: list[str] = []
    leaves: set[str] = set()
    parents: dict[str, str] = {}
    names: list[str] = []
    for switch in switches:
        name = str(switch.get("name", ""))
        if not name or ("group" in switch) == ("switches" in switch):
            raise AnsibleFilterError(
                f"slurm_switches: {switch!r} needs a name and either group (a leaf switch: its "
                "nodes' inventory group) or switches (the switches under it)"
            )
        names.append(name)
        if "group" in switch:
            if switch["group"] not in groups:
                raise AnsibleFilterError(
                    f"slurm_switches: switch {name} names the group {switch['group']}, which the "
                    "inventory does not have"
                )
            members = [host for host in groups[switch["group"]] if host in nodes]
            leaves.update(members)
            lines.append(f"SwitchName={name} Nodes={','.join(members)}")
        else:
            children = [str(child) for child in switch["switches"]]
            for child in children:
                parents.setdefault(child, name)
            lines.append(f"SwitchName={name} Switches={','.join(children)}")
    unknown = sorted(set(parents) - set(names))
    outside = [host for host in nodes if host not in leaves]
    roots = [name for name in names if name not in parents]
    if unknown or outside or len(roots) != 1:
        why = (
            f"switches {', '.join(unknown)} are not defined"
            if unknown
            else f"nodes {', '.join(outside)} are under no switch"
            if outside
            else f"switches {', '.join(roots)} have no common parent (add one whose switches "
            "are these)"
        )
        raise AnsibleFilterError(
            f"slurm_switches: {why}; Slurm runs a job only on nodes under one switch"
        )
    return lines


class FilterModule:
    def filters(self):
        return {
            "rlm_binding_commands": rlm_binding_commands,
            "rlm_slurm_node": rlm_slurm_node,
            "rlm_slurm_topology": rlm_slurm_topology,
        }

"""The rig's Ansible inventory, in the same YAML shape users write for a real cluster."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def _q(value: str) -> str:
    # A JSON string is a valid YAML double-quoted scalar; stdlib only, so the CLI needs no PyYAML.
    return json.dumps(value)


def render(
    hosts: Sequence[tuple[str, str]],
    key: Path,
    known_hosts: Path,
    shared_dir: Path,
    venv: Path,
) -> str:
    """`hosts` is [(name, ip)]; the first host is the management node."""
    ssh_args = f"-o UserKnownHostsFile={known_hosts} -o StrictHostKeyChecking=yes"
    lines = [
        "# Written by tests/rig for one rig instance; regenerated on every `up`.",
        "all:",
        "  children:",
        "    mgmt:",
        "      hosts:",
        f"        {hosts[0][0]}:",
        "    compute:",
        "      hosts:",
    ]
    for name, ip in hosts:
        lines += [
            f"        {name}:",
            f"          ansible_host: {ip}",
            "          ansible_user: root",
            f"          ansible_ssh_private_key_file: {_q(str(key))}",
            f"          ansible_ssh_common_args: {_q(ssh_args)}",
        ]
    lines += [
        "  vars:",
        # Interpreter discovery would pick the real host's pyenv shims (visible through the
        # overlay), which fail non-interactively; the system python is what real nodes have.
        "    ansible_python_interpreter: /usr/bin/python3",
        f"    rlm_shared_dir: {_q(str(shared_dir))}",
        # A directory of the real host bound into every host: no Lustre to check for.
        "    rlm_shared_fs: none",
        "    rlm_gpu_vendor: none",
        "    rlm_gpus_per_node: 1",
        f"    rlm_venv: {_q(str(venv))}",
    ]
    return "\n".join(lines) + "\n"

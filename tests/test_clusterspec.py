"""One defaults file for every site-level rlm_* variable (clusterspec/variables.yml): the roles,
the playbooks, rlmctl and file_sd take defaults only from it, and docs/variables.md is generated
from it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from clusterspec.variables import default, markdown, variables
from monitoring.file_sd import target_groups
from rlmctl import inventory

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEFAULTED = re.compile(r"\b(rlm_[a-z0-9_]+)\s*\|\s*default\(")


def ansible_files() -> list[Path]:
    return sorted([*REPO.glob("roles/**/*.yml"), *REPO.glob("playbooks/*.yml")])


def test_roles_and_playbooks_take_rlm_defaults_only_from_the_spec() -> None:
    spec = variables()
    own = []
    for path in ansible_files():
        text = path.read_text(encoding="utf-8")
        for match in DEFAULTED.finditer(text):
            name = match.group(1)
            if name not in spec:
                continue
            # Whitespace as YAML folds it (the argument specs' generated defaults wrap lines).
            rest = " ".join(text[match.end() : match.end() + 200].split())
            wanted = f"lookup('rlm.ops.rlm_default', '{name}'))"
            if spec[name].fact:
                wanted = f"ansible_facts['{spec[name].fact}']"
            if not rest.startswith(wanted):
                line = text[: match.start()].count("\n") + 1
                own.append(f"{path.relative_to(REPO)}:{line}: {name} | default({rest[:40]}")
        if path.match("roles/*/defaults/main.yml") or path.match("roles/*/vars/main.yml"):
            keys = set(yaml.safe_load(text) or {})
            own += [f"{path.relative_to(REPO)}: defines {k}" for k in sorted(keys & set(spec))]
    assert own == [], "\n".join(own)


def test_rlmctl_has_no_defaults_of_its_own() -> None:
    literal = re.compile(r"""(?:var|integer)\(\s*["'](rlm_[a-z0-9_]+)["']\s*,""")
    hits = [
        f"{path.relative_to(REPO)}: {m.group(1)}"
        for path in sorted([*REPO.glob("rlmctl/*.py"), *REPO.glob("monitoring/*.py")])
        for m in literal.finditer(path.read_text(encoding="utf-8"))
    ]
    assert hits == []


def test_a_host_without_rlm_variables_gets_the_spec_defaults_everywhere(tmp_path: Path) -> None:
    (tmp_path / "hosts.yml").write_text(
        "all:\n  children:\n    compute:\n      hosts:\n        node1: {ansible_host: 10.9.0.1}\n",
        encoding="utf-8",
    )
    host = inventory.load(tmp_path / "hosts.yml").hosts["node1"]
    assert host.gpu_vendor == default("rlm_gpu_vendor") == "auto"
    assert host.shared_dir == default("rlm_shared_dir")
    assert host.gpus_per_node == default("rlm_gpus_per_node")
    assert host.venv == default("rlm_venv")
    assert host.rdzv_port == default("rlm_rdzv_port")
    targets = target_groups(inventory.load(tmp_path / "hosts.yml"))
    assert targets["rlm-exporter"][0]["targets"] == [f"10.9.0.1:{default('rlm_exporter_port')}"]
    # What the roles see: the same defaults through the lookup, with the repository's ansible.cfg.
    names = ["rlm_gpu_vendor", "rlm_shared_dir", "rlm_gpus_per_node", "rlm_comm_busbw_floor_gbps"]
    expression = ", ".join(f"'{n}': lookup('rlm.ops.rlm_default', '{n}')" for n in names)
    result = subprocess.run(
        [
            str(BIN / "ansible"),
            "-i",
            str(tmp_path / "hosts.yml"),
            "node1",
            "-c",
            "local",
            "-m",
            "ansible.builtin.debug",
            "-a",
            f"msg={{{{ {{{expression}}} | to_json }}}}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    message = result.stdout[result.stdout.index("{") :]
    seen = json.loads(json.loads(message)["msg"])
    assert seen == {n: default(n) for n in names}


def test_docs_are_generated_from_the_spec() -> None:
    docs = (REPO / "docs/variables.md").read_text(encoding="utf-8")
    assert docs == markdown(), "regenerate: python -m clusterspec.variables > docs/variables.md"

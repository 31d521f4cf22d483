"""Every playbook passes --syntax-check; every role has the Galaxy layout and documents each
default it defines; the example inventory has the groups and variables rlmctl and the roles read."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.ansible.playbook_run import PLAYBOOKS, REPO, ansible_playbook

ROLES = sorted(p for p in (REPO / "roles").iterdir() if p.is_dir())
PLATFORMS = {"Ubuntu": {"jammy", "noble"}, "EL": {"8", "9"}}


@pytest.mark.playbook
def test_every_playbook_passes_syntax_check() -> None:
    playbooks = sorted(PLAYBOOKS.glob("*.yml"))
    proc = subprocess.run(
        [ansible_playbook(), "--syntax-check", "-i", "inventory/example"]
        + [str(p) for p in playbooks],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(playbooks) >= 8
    for playbook in playbooks:
        assert f"playbook: {playbook}" in proc.stdout


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_role_layout_and_documented_defaults(role: Path) -> None:
    meta = yaml.safe_load((role / "meta/main.yml").read_text())
    platforms = {p["name"]: set(map(str, p["versions"])) for p in meta["galaxy_info"]["platforms"]}
    for name, versions in PLATFORMS.items():
        assert versions <= platforms.get(name, set()), (role.name, platforms)
    assert (role / "tasks/main.yml").is_file()
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text()) or {}
    specs = yaml.safe_load((role / "meta/argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    assert set(defaults) <= set(options), set(defaults) - set(options)
    for name in defaults:
        assert name.startswith(f"{role.name}_"), name
    # Each default carries a comment in defaults/main.yml or a description in the spec.
    assert all(options[name].get("description") for name in defaults)


def test_example_inventory_shape() -> None:
    example = REPO / "inventory" / "example"
    hosts = yaml.safe_load((example / "hosts.yml").read_text())["all"]["children"]
    assert set(hosts["compute"]["children"]) == {"compute_amd", "compute_nvidia"}
    assert hosts["mgmt"]["hosts"]
    group_vars = {
        p.stem: yaml.safe_load(p.read_text()) for p in (example / "group_vars").glob("*.yml")
    }
    for knob in ("rlm_gpus_per_node", "rlm_shared_dir", "rlm_venv", "rlm_comm_env"):
        assert knob in group_vars["all"], knob
    assert group_vars["compute_amd"]["rlm_gpu_vendor"] == "amd"
    assert group_vars["compute_nvidia"]["rlm_gpu_vendor"] == "nvidia"


def test_one_ansible_core_floor_for_the_package_the_collection_and_every_role() -> None:
    """pyproject's ansible-core floor is meta/runtime.yml's requires_ansible (which preflight.yml
    checks the controller against) and every role's min_ansible_version."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (core,) = [
        d for d in project["optional-dependencies"]["controller"] if d.startswith("ansible-core")
    ]
    floor = re.fullmatch(r"ansible-core>=(\d+\.\d+)", core)
    assert floor, core
    runtime = yaml.safe_load((REPO / "meta/runtime.yml").read_text())
    assert runtime["requires_ansible"] == f">={floor.group(1)}.0"
    for role in ROLES:
        meta = yaml.safe_load((role / "meta/main.yml").read_text())
        assert str(meta["galaxy_info"]["min_ansible_version"]) == floor.group(1), role.name


def test_roles_copy_and_template_through_the_one_call_actions() -> None:
    """A no-change rerun costs one remote run per file only through rlm.ops.copy/template
    (plugins/action); a role that calls the builtins pays two. Lookups of the builtin template
    (rendered on the controller) are not copies and stay."""
    builtin = re.compile(r"^\s*(?:- )?ansible\.builtin\.(copy|template):", re.MULTILINE)
    offenders = [
        f"{path.relative_to(REPO)}: ansible.builtin.{match.group(1)}"
        for path in sorted((REPO / "roles").rglob("*.yml")) + sorted(PLAYBOOKS.glob("*.yml"))
        for match in builtin.finditer(path.read_text())
    ]
    assert offenders == [], "use rlm.ops.copy / rlm.ops.template: " + ", ".join(offenders)

"""The roles' argument-spec defaults, READMEs and the example inventory's list of rlm_* variables
are what clusterspec.role_docs writes from defaults/main.yml, argument_specs.yml and
clusterspec/variables.yml: edit a source and forget to regenerate, and this fails."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clusterspec import role_docs
from clusterspec.variables import default, variables

REPO = Path(__file__).resolve().parents[1]


def test_the_checked_in_files_are_what_the_generator_writes() -> None:
    stale = role_docs.stale()
    assert stale == [], f"regenerate: python -m clusterspec.role_docs ({stale})"
    assert len(role_docs.generated()) == 2 * len(role_docs.roles()) + 1 == 39


def _copy(tmp_path: Path, role: str) -> Path:
    shutil.copytree(REPO / "roles" / role, tmp_path / "roles" / role)
    (tmp_path / role_docs.EXAMPLE).parent.mkdir(parents=True)
    shutil.copy(REPO / role_docs.EXAMPLE, tmp_path / role_docs.EXAMPLE)
    return tmp_path / "roles" / role


def test_a_changed_default_is_stale_until_regenerated(tmp_path: Path) -> None:
    role = _copy(tmp_path, "gpu_power")
    assert role_docs.stale(tmp_path) == []
    defaults = role / "defaults/main.yml"
    defaults.write_text(
        defaults.read_text().replace("gpu_power_tolerance_w: 1\n", "gpu_power_tolerance_w: 7\n")
    )
    assert role_docs.stale(tmp_path) == [
        Path("roles/gpu_power/meta/argument_specs.yml"),
        Path("roles/gpu_power/README.md"),
    ]
    files = role_docs.generated(tmp_path)
    spec = yaml.safe_load(files[Path("roles/gpu_power/meta/argument_specs.yml")])
    assert spec["argument_specs"]["main"]["options"]["gpu_power_tolerance_w"]["default"] == 7
    assert "| `gpu_power_tolerance_w` | int | `7` |" in files[Path("roles/gpu_power/README.md")]


def test_a_role_default_that_reads_a_site_variable_shows_the_site_default() -> None:
    options = role_docs.argument_specs(REPO / "roles/rlm_exporter")["argument_specs"]["main"][
        "options"
    ]
    assert options["rlm_exporter_binary"]["default"] == f"{default('rlm_venv')}/bin/rlm-exporter"
    assert options["rlm_exporter_port"]["default"] == default("rlm_exporter_port")
    # Other templating is shown as written.
    assert options["rlm_exporter_address"]["default"].startswith("{{ rlm_cluster_address")
    readme = (REPO / "roles/rlm_exporter/README.md").read_text()
    assert f"| `{default('rlm_venv')}/bin/rlm-exporter` from `rlm_venv` |" in readme


def test_every_option_is_described_and_every_default_in_the_spec() -> None:
    for role in role_docs.roles():
        defaults = yaml.safe_load((role / "defaults/main.yml").read_text()) or {}
        specs = role_docs.argument_specs(role)["argument_specs"]
        for entry in specs.values():
            for name, option in entry["options"].items():
                assert option.get("description"), (role.name, name)
                assert "default" in option or option.get("required"), (role.name, name)
            assert set(defaults) <= set(entry["options"]), role.name


def test_the_example_inventory_lists_every_rlm_variable_once() -> None:
    text = "".join(p.read_text() for p in sorted((REPO / "inventory/example").rglob("*.yml")))
    everywhere = re.findall(r"^(?:# ?)?(rlm_\w+):", text, flags=re.MULTILINE)
    assert set(everywhere) == set(variables())
    listed = (REPO / role_docs.EXAMPLE).read_text().split(role_docs.EXAMPLE_MARKER)[1]
    mentioned = re.findall(r"^# (rlm_\w+):", listed, flags=re.MULTILINE)
    assert len(mentioned) == len(set(mentioned))
    # One description of each: the generated part carries variables.yml's own words.
    assert "(Ansible detects it with lspci" not in listed  # rlm_gpu_vendor is set above it
    assert "# c10d rendezvous port on the first host of a launch.\n# rlm_rdzv_port: 29500" in listed


def test_check_names_each_stale_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    role = _copy(tmp_path, "comm")
    assert role_docs.main(["--check"], root=tmp_path) == 0
    (role / "README.md").write_text("hand-edited\n")
    assert role_docs.main(["--check"], root=tmp_path) == 1
    assert capsys.readouterr().err == (
        "roles/comm/README.md: out of date: run python -m clusterspec.role_docs\n"
    )
    assert role_docs.main([], root=tmp_path) == 0
    assert role_docs.main(["--check"], root=tmp_path) == 0
    bad = subprocess.run(
        [sys.executable, "-m", "clusterspec.role_docs", "--frobnicate"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1

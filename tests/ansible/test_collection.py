"""The checkout builds into the rlm.ops collection and installs offline; ansible-doc shows the
roles' real defaults from the installed copy. (site.yml from it: test_collection_site.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from clusterspec.variables import default
from tests.ansible.collection import install
from tests.ansible.playbook_run import BIN, REPO


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install(tmp_path_factory.mktemp("collection"))


def test_the_collection_holds_the_ansible_side_and_what_it_runs(installed: Path) -> None:
    root = installed.parent / "collections/ansible_collections/rlm/ops"
    manifest = yaml.safe_load((root / "MANIFEST.json").read_text())["collection_info"]
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'\nversion = "{manifest["version"]}"\n' in pyproject
    top = {p.name for p in root.iterdir()}
    assert {"roles", "plugins", "playbooks", "meta", "clusterspec", "monitoring"} <= top
    assert not top & {
        "tests",
        "trainer",
        "rlmctl",
        "docs",
        "inventory",
        ".venv",
        ".collections",
        ".cache",
    }
    assert {p.name for p in (root / "roles").iterdir()} == {
        p.name for p in (REPO / "roles").iterdir()
    }


def test_ansible_doc_shows_a_role_s_defaults_from_the_installed_copy(installed: Path) -> None:
    proc = subprocess.run(
        [str(BIN / "ansible-doc"), "-t", "role", "--json", "rlm.ops.rlm_exporter"],
        cwd=installed.parent,
        env={**os.environ, "ANSIBLE_CONFIG": str(installed), "ANSIBLE_NOCOLOR": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = yaml.safe_load(proc.stdout)["rlm.ops.rlm_exporter"]
    options = doc["entry_points"]["main"]["options"]
    assert options["rlm_exporter_uid"]["default"] == 9410
    assert options["rlm_exporter_gpu_source"]["default"] == "auto"
    # Site variables' defaults, from clusterspec/variables.yml.
    assert options["rlm_exporter_listen_port"]["default"] == default("rlm_exporter_port")
    assert options["rlm_exporter_binary"]["default"] == f"{default('rlm_venv')}/bin/rlm-exporter"
    assert all(option.get("description") for option in options.values())

"""`pip install rlm-ops` (no extras) into a fresh venv is an exporter-only host: rlm-exporter runs
there with only its own dependencies installed (no Ansible, no Fabric, no torch). The same venv
with `[controller]` added is a torch-free controller: rlmctl works there, and torch is neither
installed nor ever imported. `rlmctl launch` validates a config with the trainer's own parser
(runcontract.config), `plan` sizes a preset, `slurm` renders a batch script and the acceptance
charts are SVG (no matplotlib) on such a controller.

The controller's install is added to the exporter's venv (one venv, one base install): the
exporter-only tests come first in this file, which pytest keeps (also under `--dist loadfile`),
and they check that no controller package is there yet.

A stand-in `torch` package on PYTHONPATH records every attempt to import it (and fails it), so a
lazy import hidden behind a caught ImportError is caught too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def source_copy(dest: Path) -> Path:
    """The packaged files only: an in-tree build/ of an earlier install must not leak in."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    for package in ("runcontract", "rlmctl", "trainer", "monitoring", "clusterspec"):
        shutil.copytree(
            REPO / package, dest / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return dest


def pip_install(root: Path, spec: str) -> None:
    subprocess.run(
        [str(root / "venv/bin/pip"), "install", "--quiet", spec],
        check=True,
        capture_output=True,
        cwd=root,
        timeout=900,
    )


@pytest.fixture(scope="module")
def exporter_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plain")
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    source = source_copy(tmp_path_factory.mktemp("source"))
    (root / "source").symlink_to(source)
    pip_install(root, str(source))
    return root


@pytest.fixture(scope="module")
def plain_install(exporter_install: Path) -> Path:
    """The exporter's venv with `[controller]` added: a controller without `[train]`."""
    pip_install(exporter_install, f"{exporter_install / 'source'}[controller]")
    return exporter_install


def installed(root: Path) -> set[str]:
    out = subprocess.run(
        [str(root / "venv/bin/pip"), "list", "--format=json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return {p["name"].lower().replace("_", "-") for p in json.loads(out.stdout)}


def run_without_torch(root: Path, *argv: str) -> subprocess.CompletedProcess:
    trap = root / "trap"
    (trap / "torch").mkdir(parents=True, exist_ok=True)
    marker = root / "torch-imported"
    (trap / "torch" / "__init__.py").write_text(
        "import pathlib, traceback\n"
        f"pathlib.Path({str(marker)!r}).write_text(''.join(traceback.format_stack()))\n"
        "raise ImportError('torch must not be imported here')\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PYTHONPATH"] = str(trap)
    result = subprocess.run(
        [str(root / "venv/bin" / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=300,
        check=False,
    )
    assert not marker.exists(), f"{argv} imported torch:\n{marker.read_text()}"
    return result


CONTROLLER_ONLY = {"ansible-core", "fabric", "paramiko", "typer", "rich", "bcrypt", "jinja2"}


def test_an_exporter_only_install_has_only_the_exporters_packages(exporter_install: Path) -> None:
    packages = installed(exporter_install)
    assert not packages & CONTROLLER_ONLY, "the controller's install was added before this test"
    assert packages - {"pip", "setuptools"} == {
        "rlm-ops", "prometheus-client", "psutil", "pyyaml"
    }  # fmt: skip


def test_exporter_once_without_torch(exporter_install: Path) -> None:
    assert not installed(exporter_install) & CONTROLLER_ONLY, "runs before [controller] is added"
    runs = exporter_install / "runs"
    (runs / "run-a").mkdir(parents=True, exist_ok=True)
    (runs / "run-a" / "status.json").write_text(
        json.dumps({"state": "running", "step": 7, "updated": 1.0}), encoding="utf-8"
    )
    result = run_without_torch(
        exporter_install, "rlm-exporter", "--once", "--gpu-source", "none", "--run-root", str(runs)
    )
    assert result.returncode == 0, result.stderr
    assert 'rlm_run_step{run="run-a"} 7.0' in result.stdout


@pytest.mark.integration
def test_torch_is_not_installed(plain_install: Path) -> None:
    python = plain_install / "venv/bin/python"
    code = "import importlib.util as u; print(u.find_spec('torch') is None, u.find_spec('numpy') is None)"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_the_acceptance_charts_are_svg_without_matplotlib(plain_install: Path) -> None:
    code = (
        "import pathlib, sys; from rlmctl import charts\n"
        "chart = charts.Chart('c', 't', 'x', 'y', {'s': [(0, 1), (1, 2)]}, [charts.Threshold(1.5, 'l')])\n"
        "print(charts.render(chart, pathlib.Path(sys.argv[1])).name)\n"
    )
    result = run_without_torch(plain_install, "python", "-c", code, str(plain_install))
    assert result.returncode == 0 and result.stdout.strip() == "c.svg", result.stderr
    assert 'class="threshold"' in (plain_install / "c.svg").read_text(encoding="utf-8")


def test_rlmctl_help_and_health_without_torch(plain_install: Path) -> None:
    assert run_without_torch(plain_install, "rlmctl", "--help").returncode == 0
    inventory = plain_install / "inventory.yml"
    (plain_install / "shared").mkdir(exist_ok=True)
    inventory.write_text(
        "all:\n  hosts:\n    localhost:\n  vars:\n    ansible_connection: local\n"
        f"    rlm_gpu_vendor: none\n    rlm_shared_dir: {plain_install / 'shared'}\n",
        encoding="utf-8",
    )
    result = run_without_torch(plain_install, "rlmctl", "-i", str(inventory), "health", "--json")
    assert result.returncode in (0, 1), result.stderr
    report = json.loads(result.stdout)
    assert [h["host"] for h in report["hosts"]] == ["localhost"]
    assert run_without_torch(plain_install, "rlmctl", "-i", str(inventory), "runs").returncode == 0
    plan = run_without_torch(plain_install, "rlmctl", "plan", "--params", "3.5e9")
    assert plan.returncode == 0 and "GPU" in plan.stdout


@pytest.mark.integration
def test_launch_plan_and_slurm_without_torch(plain_install: Path) -> None:
    """Once `launch` and `plan --model` imported the trainer's config (and with it torch) and
    failed on a controller without `[train]`."""
    shared = plain_install / "shared-launch"
    shared.mkdir(exist_ok=True)
    inventory = plain_install / "launch-inventory.yml"
    # The hosts' training environment is elsewhere: this controller has none, and the launched
    # trainer (which would import torch) cannot start here.
    inventory.write_text(
        "all:\n  hosts:\n    localhost:\n  vars:\n    ansible_connection: local\n"
        f"    rlm_gpu_vendor: none\n    rlm_gpus_per_node: 1\n    rlm_shared_dir: {shared}\n"
        "    rlm_venv: /nonexistent-training-venv\n",
        encoding="utf-8",
    )
    config = str(REPO / "trainer/configs/tiny.yaml")
    plan = run_without_torch(plain_install, "rlmctl", "plan", "--model", "huginn-3.5b")
    assert plan.returncode == 0 and "huginn-3.5b" in plan.stdout, plan.stderr
    slurm = run_without_torch(plain_install, "rlmctl", "-i", str(inventory), "slurm", "-c", config)
    assert slurm.returncode == 0 and slurm.stdout.startswith("#!/bin/bash"), slurm.stderr
    launch = ("rlmctl", "-i", str(inventory), "launch", "--config", config)
    bad = run_without_torch(plain_install, *launch, "--name", "bad", "train.micro_batch=0")
    assert bad.returncode == 2 and bad.stderr.startswith("error: "), bad.stderr
    assert "train.micro_batch" in bad.stderr and "Traceback" not in bad.stderr
    assert not (shared / "runs" / "bad").exists()
    # --force: the gate finds no trainer environment on the host, which is the point here.
    good = run_without_torch(plain_install, *launch, "--name", "nt", "--force", "train.steps=5")
    assert good.returncode == 0, good.stderr
    assert "launched nt on 1 host(s)" in good.stdout
    assert "steps: 5" in (shared / "runs" / "nt" / "config.yaml").read_text(encoding="utf-8")
    # No training python on the host: the launcher shell itself records the end of the attempt,
    # so the run does not stay `launching`.
    deadline = time.monotonic() + 60
    while (state := run_state(plain_install, inventory, "nt")) != "failed":
        assert time.monotonic() < deadline, f"run nt stayed {state}"
        time.sleep(0.5)
    record = json.loads((shared / "runs" / "nt" / "hosts" / "localhost" / "exit.json").read_text())
    assert record["exit_code"] == 127, record  # sh: the venv's python is not there


def run_state(root: Path, inventory: Path, run: str) -> str | None:
    status = run_without_torch(root, "rlmctl", "-i", str(inventory), "status", run, "--json")
    return json.loads(status.stdout)["state"]

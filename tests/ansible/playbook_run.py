"""Run ansible-playbook for real with the JSON stdout callback and read its per-task results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = REPO / "playbooks"
BIN = Path(sys.executable).parent
# Stand-ins for vendor binaries (lspci GPU rows, nvidia-smi, amd-smi, rocminfo, all_reduce_perf).
FAKE_VENDOR_BIN = Path(__file__).parent / "fixtures" / "bin"


@dataclass
class TaskResult:
    play: str
    task: str
    host: str
    result: dict[str, Any]

    @property
    def changed(self) -> bool:
        return bool(self.result.get("changed")) or any(
            item.get("changed") for item in self.result.get("results", [])
        )

    @property
    def failed(self) -> bool:
        return bool(self.result.get("failed")) or any(
            item.get("failed") for item in self.result.get("results", [])
        )

    @property
    def skipped(self) -> bool:
        return bool(self.result.get("skipped"))


@dataclass
class PlaybookRun:
    rc: int
    report: dict[str, Any]
    stderr: str

    @property
    def results(self) -> list[TaskResult]:
        out = []
        for play in self.report.get("plays", []):
            for task in play["tasks"]:
                for host, result in task["hosts"].items():
                    out.append(TaskResult(play["play"]["name"], task["task"]["name"], host, result))
        return out

    def task(self, host: str, name: str) -> TaskResult:
        """The last result of the task whose name ends with `name` on `host`."""
        found = [r for r in self.results if r.host == host and r.task.endswith(name)]
        assert found, f"task {name!r} did not run on {host}; ran: {self.names(host)}"
        return found[-1]

    def ran(self, host: str, name: str) -> bool:
        return any(r.host == host and r.task.endswith(name) and not r.skipped for r in self.results)

    def names(self, host: str) -> list[str]:
        return [r.task for r in self.results if r.host == host]

    def changed(self, host: str) -> list[str]:
        return [r.task for r in self.results if r.host == host and r.changed]

    def failures(self, host: str) -> list[str]:
        return [
            f"{r.task}: {r.result.get('msg', '')}"
            for r in self.results
            if r.host == host and r.failed and not r.result.get("ignored", False)
        ]

    def stats(self, host: str) -> dict[str, int]:
        return self.report["stats"][host]


def write_inventory(path: Path, inventory: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return path


def ansible_playbook() -> str:
    """The ansible-playbook of this venv; refused in `make check`, the lane that runs no playbook.

    tests/conftest.py marks every test module that imports `run_playbook` as `playbook`; a test
    that reaches ansible-playbook some other way fails here instead of slowing the fast lane.
    """
    if os.environ.get("RLM_TEST_LANE") == "check":
        raise AssertionError(
            "this test runs ansible-playbook, which `make check` never does: "
            "mark it @pytest.mark.playbook (or import run_playbook in its module)"
        )
    return str(BIN / "ansible-playbook")


def run_playbook(
    playbook: str | Path,
    inventory: Path,
    work_dir: Path,
    *,
    check: bool = False,
    tags: str | None = None,
    skip_tags: str | None = None,
    limit: str | None = None,
    extra_vars: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> PlaybookRun:
    """ansible-playbook with the repository's ansible.cfg, a private fact cache and JSON output.

    `playbook`: a file under playbooks/, or a collection's playbook by name (rlm.ops.site).
    """
    named = isinstance(playbook, str) and playbook.startswith("rlm.ops.")
    argv = [
        ansible_playbook(),
        "-i",
        str(inventory),
        playbook if named else str(PLAYBOOKS / playbook),
    ]
    if check:
        argv += ["--check", "--diff"]
    if tags:
        argv += ["--tags", tags]
    if skip_tags:
        argv += ["--skip-tags", skip_tags]
    if limit:
        argv += ["--limit", limit]
    if extra_vars:
        vars_file = work_dir / "extra-vars.json"
        vars_file.write_text(json.dumps(extra_vars))
        argv += ["-e", f"@{vars_file}"]
    run_env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json",
        # profile_tasks (ansible.cfg) prints to stdout, which must hold only the JSON report;
        # junit writes its file aside instead.
        "ANSIBLE_CALLBACKS_ENABLED": "ansible.builtin.junit",
        "JUNIT_OUTPUT_DIR": str(work_dir / "junit"),
        # Rig hosts are named node1..N in every rig: never reuse another run's cached facts.
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(work_dir / "facts"),
        "ANSIBLE_LOCAL_TEMP": str(work_dir / "ansible-tmp"),
        "ANSIBLE_NOCOLOR": "1",
        **(env or {}),
    }
    proc = subprocess.run(
        argv, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=timeout
    )
    try:
        report = json.loads(proc.stdout[proc.stdout.index("{") :])
    except ValueError as error:
        raise AssertionError(
            f"no JSON report (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        ) from error
    return PlaybookRun(proc.returncode, report, proc.stderr)

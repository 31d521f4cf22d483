"""`rlm.ops.copy` and `rlm.ops.template` (plugins/action/): the builtins, but a file already right
costs one remote Python run, not two.

Counted for real: the hosts' interpreter is a script that logs each run and then execs Python,
so the counts below are the remote module runs Ansible made (through a local connection). The
builtins run in the same playbooks, so a test fails if the saving disappears or a result differs.
"""

from __future__ import annotations

import os
import pwd
import sys
from pathlib import Path

import pytest
import yaml

from plugins.action.copy import attributes_match, wanted_mode
from tests.ansible.playbook_run import PlaybookRun, run_playbook, write_inventory

FILES = ("rendered", "from-content", "from-src")


def play(directory: Path, action: str) -> list[dict]:
    template, copy = f"{action}.template", f"{action}.copy"
    (directory / "unit.j2").write_text("[Unit]\nDescription={{ inventory_hostname }} unit\n")
    (directory / "source.conf").write_text("key = value\n")
    out = directory / "out"
    return [
        {
            "hosts": "all",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "rendered",
                    template: {
                        "src": str(directory / "unit.j2"),
                        "dest": f"{out}/rendered",
                        "mode": "0640",
                        "owner": "root",
                        "group": "root",
                    },
                },
                {
                    "name": "from-content",
                    copy: {"content": "a = 1\n", "dest": f"{out}/from-content", "mode": "0600"},
                },
                {
                    "name": "from-src",
                    copy: {
                        "src": str(directory / "source.conf"),
                        "dest": f"{out}/from-src",
                        "mode": 0o644,
                    },
                },
            ],
        }
    ]


@pytest.fixture
def site(tmp_path: Path):
    """A host through a local connection whose interpreter logs every run; returns a runner."""
    log = tmp_path / "runs.log"
    interpreter = tmp_path / "python"
    interpreter.write_text(f'#!/bin/sh\necho run >> {log}\nexec {sys.executable} "$@"\n')
    interpreter.chmod(0o755)
    inventory = write_inventory(
        tmp_path / "hosts.yml",
        {
            "all": {
                "hosts": {
                    "here": {
                        "ansible_connection": "local",
                        "ansible_python_interpreter": str(interpreter),
                    }
                }
            }
        },
    )
    (tmp_path / "out").mkdir()

    def run(action: str, *, check: bool = False) -> tuple[PlaybookRun, int]:
        playbook = tmp_path / f"{action}.yml"
        playbook.write_text(yaml.safe_dump(play(tmp_path, action)))
        log.write_text("")
        result = run_playbook(playbook, inventory, tmp_path, check=check)
        assert result.rc == 0, result.failures("here")
        return result, len(log.read_text().splitlines())

    return run, tmp_path / "out"


def test_an_unchanged_file_costs_one_remote_run_where_the_builtin_costs_two(site) -> None:
    run, out = site
    first, first_runs = run("rlm.ops")
    assert first.changed("here") == list(FILES)
    assert first_runs == 2 * len(FILES)  # stat, then copy: the stat is not asked twice
    builtin, builtin_runs = run("ansible.builtin")
    again, runs = run("rlm.ops")
    assert builtin.changed("here") == [] and again.changed("here") == []
    assert builtin_runs == 2 * len(FILES)
    assert runs == len(FILES)
    for name in FILES:
        ours, theirs = again.task("here", name).result, builtin.task("here", name).result
        for key in ("dest", "checksum", "owner", "group", "mode", "uid", "gid", "size", "state"):
            assert ours[key] == theirs[key], (name, key)
    assert (out / "rendered").read_text() == "[Unit]\nDescription=here unit\n"
    assert oct((out / "from-src").stat().st_mode & 0o777) == "0o644"


def test_content_owner_and_mode_drift_are_repaired_and_check_mode_changes_nothing(site) -> None:
    run, out = site
    run("rlm.ops")
    nobody = pwd.getpwnam("nobody")
    os.chown(out / "rendered", nobody.pw_uid, 0)
    (out / "from-content").chmod(0o644)
    (out / "from-src").write_text("key = edited by hand\n")
    planned, _ = run("rlm.ops", check=True)
    assert planned.changed("here") == list(FILES)
    assert (out / "rendered").stat().st_uid == nobody.pw_uid
    assert (out / "from-src").read_text() == "key = edited by hand\n"
    repaired, _ = run("rlm.ops")
    assert repaired.changed("here") == list(FILES)
    assert (out / "rendered").stat().st_uid == 0
    assert (out / "from-content").stat().st_mode & 0o777 == 0o600
    assert (out / "from-src").read_text() == "key = value\n"
    settled, runs = run("rlm.ops")
    assert settled.changed("here") == [] and runs == len(FILES)


def test_a_symlink_at_the_destination_is_left_to_the_builtin(site) -> None:
    run, out = site
    run("rlm.ops")
    target = out / "elsewhere"
    (out / "from-src").rename(target)
    (out / "from-src").symlink_to(target)
    again, runs = run("rlm.ops")
    assert again.changed("here") == ["from-src"]
    assert runs == len(FILES) + 1  # the builtin's copy, on the stat already made
    assert not (out / "from-src").is_symlink()


@pytest.mark.parametrize(
    ("mode", "bits"),
    [
        ("0644", 0o644),
        ("644", 0o644),
        (0o600, 0o600),
        ("u=rw,g=r", None),
        ("preserve", None),
        (True, None),
        ("", None),
    ],
)
def test_only_octal_modes_are_judged_from_the_stat(mode: object, bits: int | None) -> None:
    assert wanted_mode(mode) == bits


def test_owner_and_group_match_by_name_or_id() -> None:
    status = {"pw_name": "rlm", "uid": 990, "gr_name": "rlm", "gid": 990, "mode": "0640"}
    assert attributes_match({"owner": "rlm", "group": 990, "mode": "0640"}, status)
    assert attributes_match({}, status)
    assert not attributes_match({"owner": "root"}, status)
    assert not attributes_match({"mode": "0644"}, status)
    assert not attributes_match({"mode": "u=rw"}, status)

"""The rlm.ops collection built from this checkout and installed offline, as a site installs it.

`install(work)` runs `ansible-galaxy collection build` and `ansible-galaxy collection install
--offline` into work/collections and returns an ansible.cfg that knows only that copy (no
roles_path, no checkout), for ansible-doc and ansible-playbook to use.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.ansible.playbook_run import BIN, REPO


def install(work: Path) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    config = work / "ansible.cfg"
    config.write_text(f"[defaults]\ncollections_path = {work / 'collections'}\n")
    env = {**os.environ, "ANSIBLE_CONFIG": str(config), "ANSIBLE_NOCOLOR": "1"}

    def galaxy(*argv: str) -> None:
        proc = subprocess.run(
            [str(BIN / "ansible-galaxy"), "collection", *argv],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr

    galaxy("build", "--output-path", str(work), str(REPO))
    [archive] = work.glob("rlm-ops-*.tar.gz")
    galaxy("install", "--offline", str(archive))
    return config

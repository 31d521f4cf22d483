"""The shared directory's verdict (clusterspec/shared_dir.py), the one `rlmctl health` and
playbooks/verify.yml both give, on real directories of this machine with a real unprivileged
service user (`nobody`): each property of the table in docs/provisioning.md, and advice that
fits the site's rlm_shared_fs. Run as verify.yml runs it: the file itself, by the system's
python3, as root. The two callers agreeing on systemd nodes: test_site_systemd.py.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterspec import shared_dir

USER = "nobody"
# A node's interpreter, which the service user may run (this venv's may live under /root).
SYSTEM_PYTHON = "/usr/bin/python3"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the write probe runs as the service user: needs root"
)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A shared directory with its runs/, both the service user's, as site.yml leaves them; under
    /var/tmp, whose every parent the user can traverse (pytest's tmp_path is root's alone)."""
    user = pwd.getpwnam(USER)
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="rlm-shared-dir-test-") as tmp:
        path = Path(tmp)
        os.chmod(path, 0o755)
        (path / "runs").mkdir()
        for directory in (path, path / "runs"):
            os.chown(directory, user.pw_uid, user.pw_gid)
        yield path


def verdict(path: Path, fs: str = "none", user: str | None = USER, floor: float = 0) -> dict:
    cfg = {"path": str(path), "user": user, "fs": fs, "min_free_gib": floor}
    argv = [SYSTEM_PYTHON, shared_dir.__file__, json.dumps(cfg)]
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


def test_a_provisioned_directory_is_ok(shared: Path) -> None:
    result = verdict(shared)
    assert result["state"] == "OK", result
    assert result["detail"].endswith(f"owned by {USER}") and result["fix"] == ""


def test_a_missing_directory_asks_for_what_the_site_mounts(tmp_path: Path) -> None:
    """With rlm_shared_fs: none rlm-ops mounts nothing: the advice never says site.yml can."""
    absent = tmp_path / "absent"
    none = verdict(absent)
    assert none["state"] == "CRIT" and none["detail"] == f"{absent} does not exist"
    assert none["fix"] == (
        f"mount the site's shared filesystem (NFS, ...) at {absent} on this node: with "
        "rlm_shared_fs: none rlm-ops mounts nothing, so site.yml cannot do it"
    )
    lustre = verdict(absent, fs="lustre")
    assert lustre["fix"].startswith(
        f"mount Lustre at {absent}: ansible-playbook playbooks/site.yml"
    )


def test_a_root_owned_runs_is_critical_with_the_fix_for_the_site(shared: Path) -> None:
    """The case the issue found: runs/ made by root before provisioning."""
    os.chown(shared / "runs", 0, 0)
    none = verdict(shared)
    assert none["state"] == "CRIT"
    # Owned by root, and (mode 0755) the service user cannot create runs there either.
    assert none["detail"].startswith(f"{shared}/runs is owned by root, not {USER}; ")
    assert f"{USER} cannot write in {shared}/runs: Permission denied" in none["detail"]
    # One fix: giving runs/ to the user is what lets it write there.
    assert none["fix"] == (
        f"chown {USER}: {shared}/runs (site.yml does it: --tags users_ssh gives {shared} "
        "and its runs/ to the service user)"
    )
    # On Lustre the filesystem root is Lustre's: chown once from a client, not the role.
    lustre = verdict(shared, fs="lustre")
    assert f"chown {USER}: {shared}/runs once, from any client" in lustre["fix"]


def test_writable_is_tried_as_the_service_user(shared: Path) -> None:
    """Owner right, mode wrong: only a write as the user finds it (root could write)."""
    os.chmod(shared / "runs", 0o555)
    result = verdict(shared)
    assert result["state"] == "CRIT", result
    assert result["detail"] == f"{USER} cannot write in {shared}/runs: Permission denied"
    assert result["fix"] == f"give {USER} write access to {shared}/runs"


def test_lustre_named_but_a_local_directory_in_its_place(shared: Path) -> None:
    point, fstype, _ = shared_dir.mount_of(str(shared))
    assert fstype != "lustre"
    result = verdict(shared, fs="lustre")
    assert result["state"] == "CRIT"
    assert (
        f"{shared} is on {fstype} (" in result["detail"]
        and f"at {point}), not lustre" in (result["detail"])
    )
    assert "rlm_shared_fs: lustre; the lustre_client role mounts it" in result["fix"]


def test_free_space_under_the_floor(shared: Path) -> None:
    free_gib = os.statvfs(shared).f_bavail * os.statvfs(shared).f_frsize / 2**30
    result = verdict(shared, floor=free_gib + 1000)
    assert result["state"] == "CRIT"
    assert "(rlm_shared_min_free_gib)" in result["detail"]
    assert result["fix"].startswith(f"free space under {shared}")


def test_a_node_without_the_service_user_is_a_warning(shared: Path) -> None:
    """Not provisioned yet: ownership cannot be judged; the write is tried as the checker."""
    result = verdict(shared, user="rlm-no-such-user")
    assert result["state"] == "WARN", result
    assert "the service user rlm-no-such-user does not exist here" in result["detail"]
    assert result["fix"].startswith("run site.yml (users_ssh creates rlm-no-such-user")

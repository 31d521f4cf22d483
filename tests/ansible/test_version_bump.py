"""A version bump in the inventory converges on a systemd rig node: node_exporter_version changed
from bookworm's node_exporter to a newer one the site's mirror carries, the next run installs it
and restarts the daemon, which then reports the new version; a rerun changes nothing.

The node's only package source is the rig's local repository (bookworm's 1.5.0); the "mirror"
that gets the new version is a second flat repository on the shared directory holding trixie's
1.9.0 package (from the rig's trixie image: it depends on nothing bookworm lacks)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.ansible.playbook_run import PlaybookRun, run_playbook, write_inventory
from tests.ansible.systemd_site import connection_vars
from tests.rig import Rig
from tests.rig.image import ensure_image
from tests.test_rig_systemd import systemd_unavailable

pytestmark = pytest.mark.rig
SLOT = 3  # docs/rig.md: this module's slot
PACKAGE = "prometheus-node-exporter"
UNIT = "prometheus-node-exporter.service"


def package_version(repo: Path) -> str:
    [deb] = repo.glob(f"{PACKAGE}_*.deb")
    return deb.name.split("_")[1]


class Node:
    def __init__(self, rig: Rig, work: Path) -> None:
        self.rig, self.work, self.host = rig, work, rig.hosts[0]
        self.playbook = work / "node_exporter.yml"
        self.playbook.write_text(
            yaml.safe_dump(
                [
                    {
                        "name": "node_exporter",
                        "hosts": "all",
                        "gather_facts": True,
                        "gather_subset": ["min"],
                        "roles": ["node_exporter"],
                    }
                ]
            )
        )

    def apply(self, version: str) -> PlaybookRun:
        hosts = {
            name: {**conn, "ansible_python_interpreter": "/usr/bin/python3"}
            for name, conn in connection_vars(self.rig).items()
        }
        inventory = {"all": {"hosts": hosts, "vars": {"node_exporter_version": version}}}
        run = run_playbook(
            self.playbook, write_inventory(self.work / "hosts.yml", inventory), self.work
        )
        assert run.rc == 0 and not run.failures(self.host.name), (
            run.failures(self.host.name),
            run.stderr[-2000:],
        )
        return run

    def sh(self, command: str) -> str:
        return self.rig.exec(self.host, command).stdout.strip()

    def binary_version(self) -> str:
        return self.sh(f"{PACKAGE} --version 2>&1 | head -1")

    def served_version(self) -> str:
        """node_exporter_build_info's version label, from the running daemon's /metrics."""
        script = (
            "import re, urllib.request; "
            "text = urllib.request.urlopen('http://127.0.0.1:9100/metrics', timeout=10).read(); "
            'print(re.search(rb\'node_exporter_build_info\\{[^}]*version="([^"]+)"\', text)[1]'
            ".decode())"
        )
        return self.rig.exec(self.host, ["python3", "-c", script]).stdout.strip()

    def main_pid(self) -> str:
        return self.sh(f"systemctl show -P MainPID {UNIT}")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    if reason := systemd_unavailable():
        pytest.skip(reason)
    ensure_image("trixie")  # the newer package's source (built once, cached)
    with Rig(1, slot=SLOT, release="bookworm") as rig:
        yield Node(rig, tmp_path_factory.mktemp("version-bump"))
        # Leave nothing of the mirror behind on the shared directory.
        shutil.rmtree(rig.shared_dir / "mirror", ignore_errors=True)


def test_a_version_bump_installs_the_new_version_and_restarts_on_it(node: Node) -> None:
    old = package_version(ensure_image("bookworm").repo)
    new = package_version(ensure_image("trixie").repo)
    assert old.split("-")[0] != new.split("-")[0], (old, new)

    node.sh("apt-get update -qq")  # what the base play (roles/common) does first in site.yml
    first = node.apply(old)
    assert first.task(node.host.name, "Install node_exporter").changed
    assert old.split("-")[0] in node.binary_version()
    wait_active(node)
    assert node.served_version() == old.split("-")[0]
    pid_before = node.main_pid()

    # The site's mirror gets the new version (a second flat repository, as a mirror sync would).
    mirror = node.rig.shared_dir / "mirror"
    mirror.mkdir()
    [deb] = ensure_image("trixie").repo.glob(f"{PACKAGE}_*.deb")
    shutil.copy(deb, mirror)
    packages = subprocess.run(
        ["apt-ftparchive", "packages", "."], cwd=mirror, capture_output=True, check=True
    ).stdout
    (mirror / "Packages").write_bytes(packages)
    node.sh(
        f"echo 'deb [trusted=yes] file:{mirror} ./' > /etc/apt/sources.list.d/mirror.list"
        " && apt-get update -qq"
    )

    bumped = node.apply(new)
    assert bumped.task(node.host.name, "Install node_exporter").changed
    assert new.split("-")[0] in node.binary_version()
    assert node.sh(f"dpkg-query -W -f '${{Version}}' {PACKAGE}") == new
    wait_active(node)
    assert node.main_pid() != pid_before
    assert node.served_version() == new.split("-")[0]

    again = node.apply(new)
    assert again.stats(node.host.name)["changed"] == 0, again.changed(node.host.name)


def wait_active(node: Node) -> None:
    """The role's own probe waited for /metrics; the unit must be active on the new binary."""
    assert node.sh(f"systemctl is-active {UNIT}") == "active"
    exe = node.sh(f"readlink /proc/{node.main_pid()}/exe")
    assert exe.endswith(PACKAGE), exe

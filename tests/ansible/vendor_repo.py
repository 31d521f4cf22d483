"""Signed apt repositories of stand-in vendor packages, laid out as a site's mirror of a
vendor repository would be, for tests that install the GPU roles' packages on rig nodes.

The rig has no vendor repositories (no route out) and no GPUs, and the real packages are
gigabytes of kernel modules and libraries that would not load here anyway. What the version
tests need is what apt sees: the package NAMES the roles install, at two or more versions each,
in a repository signed by a key the role installs (the roles' `*_repo_key_src`). So each stand-in
is a tiny .deb built with `dpkg-deb --build`: the real name, a version in the vendor's format, a
description saying it is a stand-in, and, where the real package ships a systemd unit the role
enables (nvidia-persistenced, nvidia-fabricmanager), a unit of that name that runs /bin/true.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.rig.image import index_flat_repo


@dataclass(frozen=True)
class StandIn:
    name: str
    version: str
    depends: tuple[str, ...] = ()
    units: tuple[str, ...] = ()  # systemd units the real package ships


UNIT = """[Unit]
Description=rlm-ops test stand-in for {name} (no GPU on the rig)

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/true

[Install]
WantedBy=multi-user.target
"""


def build_deb(package: StandIn, out_dir: Path, build_dir: Path) -> Path:
    root = build_dir / f"{package.name}_{package.version}"
    (root / "DEBIAN").mkdir(parents=True)
    control = [
        f"Package: {package.name}",
        f"Version: {package.version}",
        "Architecture: amd64",
        "Maintainer: rlm-ops tests <tests@rlm-ops.invalid>",
        f"Description: rlm-ops test stand-in for {package.name} (not the vendor's package)",
    ]
    if package.depends:
        control.append("Depends: " + ", ".join(package.depends))
    (root / "DEBIAN" / "control").write_text("\n".join(control) + "\n")
    for unit in package.units:
        path = root / "usr/lib/systemd/system" / f"{unit}.service"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(UNIT.format(name=unit))
    deb = out_dir / f"{package.name}_{package.version}_amd64.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)],
        check=True,
        capture_output=True,
    )
    return deb


class SigningKey:
    """A throwaway OpenPGP key in its own GnuPG home: signs the repository's InRelease."""

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(mode=0o700, parents=True)
        self.gpg(
            "--quick-generate-key", "rlm-ops test vendor repository", "ed25519", "sign", "never"
        )
        self.public = home / "repo-key.asc"
        self.public.write_bytes(self.gpg("--armor", "--export"))

    def gpg(self, *args: str) -> bytes:
        argv = ["gpg", "--homedir", str(self.home), "--batch", "--pinentry-mode", "loopback"]
        argv += ["--passphrase", "", *args]
        return subprocess.run(argv, check=True, capture_output=True).stdout

    def clearsign(self, path: Path, out: Path) -> None:
        self.gpg("--yes", "--clearsign", "--output", str(out), str(path))


def write_flat_repo(repo: Path, packages: list[StandIn], key: SigningKey, build_dir: Path) -> None:
    """A flat repository (`Suites: /`) in `repo`: the .debs, Packages and a signed InRelease.
    Called again with more packages, it adds them (a mirror sync)."""
    repo.mkdir(parents=True, exist_ok=True)
    for package in packages:
        build_deb(package, repo, build_dir)
    index_flat_repo(repo)
    key.clearsign(repo / "Release", repo / "InRelease")


def write_suite_repo(
    repo: Path, suite: str, packages: list[StandIn], key: SigningKey, build_dir: Path
) -> None:
    """A repository with a dists/ tree (`Suites: <suite>`, `Components: main`, amd64), as AMD
    publishes amdgpu and ROCm: the .debs under pool/, the index and a signed InRelease."""
    pool = repo / "pool" / "main"
    pool.mkdir(parents=True, exist_ok=True)
    for package in packages:
        build_deb(package, pool, build_dir)
    dist = repo / "dists" / suite
    binary = dist / "main" / "binary-amd64"
    binary.mkdir(parents=True, exist_ok=True)
    index = subprocess.run(
        ["apt-ftparchive", "packages", "pool"], cwd=repo, check=True, capture_output=True
    ).stdout
    (binary / "Packages").write_bytes(index)
    options = {"Suite": suite, "Codename": suite, "Components": "main", "Architectures": "amd64"}
    argv = ["apt-ftparchive"]
    for name, value in options.items():
        argv += ["-o", f"APT::FTPArchive::Release::{name}={value}"]
    release = subprocess.run(
        [*argv, "release", "."], cwd=dist, check=True, capture_output=True
    ).stdout
    (dist / "Release").write_bytes(release)
    key.clearsign(dist / "Release", dist / "InRelease")

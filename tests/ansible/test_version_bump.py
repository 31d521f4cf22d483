"""A version bump in the inventory converges on a systemd rig node.

Monitoring: node_exporter_version, prometheus_version and alertmanager_version changed from
bookworm's packages to newer ones the site's mirror carries; the next run installs them and
restarts each daemon, which then reports the new version; a rerun changes nothing.
The node's only package source is the rig's local repository (bookworm's node_exporter 1.5.0,
Prometheus 2.42.0, Alertmanager 0.25.0); the "mirror" that gets the new versions is a second flat
repository on the shared directory holding trixie's packages (node_exporter 1.9.0, Prometheus
2.53.3 with promtool, which trixie splits into its own package, Alertmanager 0.28.1), from the rig's
trixie image. `dpkg-deb -f` on them: they depend on libc6 (>= 2.34), adduser, tzdata, the web
assets' libjs-* packages and init-system-helpers (>= 1.54~), all of which bookworm has (2.36,
1.65.2), so they install on bookworm as they would from a site's mirror of a newer release.

GPU vendors: gpu_nvidia's driver and NCCL versions and gpu_amd's ROCm release, bumped, install the
new packages (dpkg-query), an `apt-get upgrade` in between does not move past the pins, and the
role reports "reboot required" (no driver loads here). The rig has no vendor repositories and no
GPUs, so the vendor packages are stand-ins with the real names in signed local repositories laid
out like the vendors' (tests/ansible/vendor_repo.py says why and how)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible.playbook_run import PlaybookRun, run_playbook, write_inventory
from tests.ansible.systemd_site import connection_vars
from tests.ansible.vendor_repo import SigningKey, StandIn, write_flat_repo, write_suite_repo
from tests.rig import Rig
from tests.rig.image import ensure_image, index_flat_repo
from tests.test_rig_systemd import systemd_unavailable

pytestmark = pytest.mark.rig
SLOT = 3  # docs/rig.md: this module's slot


@dataclass(frozen=True)
class Daemon:
    """One version-pinned package of the monitoring roles and how its daemon reports its version."""

    variable: str  # the role's version variable
    package: str
    unit: str
    binary: str
    task: str  # the role's install task
    url: str  # what the running daemon serves, and where its version is in the JSON
    path: tuple[str, ...]


NODE_EXPORTER = Daemon(
    "node_exporter_version",
    "prometheus-node-exporter",
    "prometheus-node-exporter.service",
    "/usr/bin/prometheus-node-exporter",
    "Install node_exporter",
    "http://127.0.0.1:9100/metrics",
    (),
)
PROMETHEUS = Daemon(
    "prometheus_version",
    "prometheus",
    "prometheus.service",
    "/usr/bin/prometheus",
    "Install Prometheus",
    "http://127.0.0.1:9090/api/v1/status/buildinfo",
    ("data", "version"),
)
ALERTMANAGER = Daemon(
    "alertmanager_version",
    "prometheus-alertmanager",
    "prometheus-alertmanager.service",
    "/usr/bin/prometheus-alertmanager",
    "Install Alertmanager",
    "http://127.0.0.1:9093/api/v2/status",
    ("versionInfo", "version"),
)
DAEMONS = (NODE_EXPORTER, PROMETHEUS, ALERTMANAGER)
# Versions only: the daemons on loopback with no login and no receiver (the defaults, the cluster
# address and a login, are tested in test_site_systemd.py).
MONITORING_ON_LOOPBACK = {
    "node_exporter_listen": "127.0.0.1:9100",
    "prometheus_listen": "127.0.0.1:9090",
    "alertmanager_listen": "127.0.0.1:9093",
    "prometheus_alertmanager_target": "127.0.0.1:9093",
    "rlm_monitoring_basic_auth": False,
    "rlm_alert_allow_no_receiver": True,
}
# What the mirror must carry besides the daemons' own packages: trixie's prometheus depends on
# promtool, which bookworm's prometheus contains.
MIRROR_EXTRA = ("promtool",)


def package_version(repo: Path, package: str) -> str:
    [deb] = repo.glob(f"{package}_*.deb")
    return deb.name.split("_")[1]


def upstream(version: str) -> str:
    """1.5.0-1+b6 -> 1.5.0, 2.53.3+ds1-2 -> 2.53.3: what the daemon's build info says."""
    match = re.match(r"\d+(\.\d+)+", version)
    assert match, version
    return match[0]


class Node:
    def __init__(self, rig: Rig, work: Path) -> None:
        self.rig, self.work, self.host = rig, work, rig.hosts[0]

    def playbook(self, name: str, plays: list[dict[str, Any]]) -> Path:
        path = self.work / f"{name}.yml"
        path.write_text(yaml.safe_dump(plays))
        return path

    def apply(self, playbook: Path, variables: dict[str, Any]) -> PlaybookRun:
        """One real run of `playbook` on the node (in group mgmt) with these inventory vars."""
        hosts = {
            name: {**conn, "ansible_python_interpreter": "/usr/bin/python3"}
            for name, conn in connection_vars(self.rig).items()
        }
        inventory = {"all": {"vars": variables, "children": {"mgmt": {"hosts": hosts}}}}
        run = run_playbook(playbook, write_inventory(self.work / "hosts.yml", inventory), self.work)
        assert run.rc == 0 and not run.failures(self.host.name), (
            run.failures(self.host.name),
            run.stderr[-2000:],
        )
        return run

    def sh(self, command: str) -> str:
        return self.rig.exec(self.host, command).stdout.strip()

    def installed(self, daemon: Daemon) -> str:
        return self.sh(f"dpkg-query -W -f '${{Version}}' {daemon.package}")

    def binary_version(self, daemon: Daemon) -> str:
        return self.sh(f"{daemon.binary} --version 2>&1 | head -1")

    def served_version(self, daemon: Daemon) -> str:
        """The running daemon's own word: node_exporter_build_info's version label, Prometheus'
        buildinfo, Alertmanager's status."""
        body = self.rig.exec(
            self.host,
            [
                "python3",
                "-c",
                f"import urllib.request as u; "
                f"print(u.urlopen({daemon.url!r}, timeout=10).read().decode())",
            ],
        ).stdout
        if not daemon.path:
            return re.search(r'node_exporter_build_info\{[^}]*version="([^"]+)"', body)[1]
        value = json.loads(body)
        for key in daemon.path:
            value = value[key]
        return value

    def main_pid(self, daemon: Daemon) -> str:
        return self.sh(f"systemctl show -P MainPID {daemon.unit}")

    def assert_runs(self, daemon: Daemon, version: str) -> None:
        """Installed, and the unit active on that package's binary, which reports the version."""
        assert self.installed(daemon) == version, daemon
        assert upstream(version) in self.binary_version(daemon), daemon
        assert self.sh(f"systemctl is-active {daemon.unit}") == "active", daemon
        exe = self.sh(f"readlink /proc/{self.main_pid(daemon)}/exe")
        assert exe == daemon.binary, (daemon, exe)
        assert upstream(self.served_version(daemon)) == upstream(version), daemon

    def add_mirror(self, debs: list[Path]) -> None:
        """The site's mirror gets the new versions (a second flat repository, as a sync would)."""
        mirror = self.rig.shared_dir / "mirror"
        mirror.mkdir()
        for deb in debs:
            shutil.copy(deb, mirror)
        index_flat_repo(mirror)
        self.sh(
            f"echo 'deb [trusted=yes] file:{mirror} ./' > /etc/apt/sources.list.d/mirror.list"
            " && apt-get update -qq"
        )


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    if reason := systemd_unavailable():
        pytest.skip(reason)
    ensure_image("trixie")  # the newer packages' source (built once, cached)
    with Rig(1, slot=SLOT, release="bookworm") as rig:
        yield Node(rig, tmp_path_factory.mktemp("version-bump"))
        # Leave nothing of the mirror behind on the shared directory.
        for mirror in ("mirror", "vendor"):
            shutil.rmtree(rig.shared_dir / mirror, ignore_errors=True)


def test_a_version_bump_installs_the_new_versions_and_restarts_on_them(node: Node) -> None:
    old_repo, new_repo = ensure_image("bookworm").repo, ensure_image("trixie").repo
    old = {daemon: package_version(old_repo, daemon.package) for daemon in DAEMONS}
    new = {daemon: package_version(new_repo, daemon.package) for daemon in DAEMONS}
    for daemon in DAEMONS:
        assert upstream(old[daemon]) != upstream(new[daemon]), (daemon, old, new)

    # monitoring.yml's plays for these roles (rlm_exporter and the GPU exporter have no pin).
    play = {"hosts": "mgmt", "gather_facts": True, "gather_subset": ["min"]}
    playbook = node.playbook(
        "monitoring",
        [
            {"name": "Exporters", **play, "roles": ["node_exporter"]},
            {"name": "Monitoring", **play, "roles": ["alertmanager", "prometheus"]},
        ],
    )

    def apply(versions: dict[Daemon, str]) -> PlaybookRun:
        pins = {daemon.variable: v for daemon, v in versions.items()}
        return node.apply(playbook, {**MONITORING_ON_LOOPBACK, **pins})

    node.sh("apt-get update -qq")  # what the base play (roles/common) does first in site.yml
    first = apply(old)
    pids_before = {}
    for daemon in DAEMONS:
        assert first.task(node.host.name, daemon.task).changed, daemon
        node.assert_runs(daemon, old[daemon])
        pids_before[daemon] = node.main_pid(daemon)

    debs = [next(new_repo.glob(f"{d.package}_*.deb")) for d in DAEMONS]
    node.add_mirror(debs + [next(new_repo.glob(f"{p}_*.deb")) for p in MIRROR_EXTRA])

    bumped = apply(new)
    for daemon in DAEMONS:
        assert bumped.task(node.host.name, daemon.task).changed, daemon
        node.assert_runs(daemon, new[daemon])
        assert node.main_pid(daemon) != pids_before[daemon], daemon

    again = apply(new)
    assert again.stats(node.host.name)["changed"] == 0, again.changed(node.host.name)


# NVIDIA: the driver (Ubuntu's CUDA repository: nvidia-open-<branch>), fabric manager at exactly the
# driver's version, NCCL and the CUDA compiler comm builds nccl-tests with, and the kernel headers.
# Stand-ins (tests/ansible/vendor_repo.py): two real R550 releases and two NCCL versions in the
# vendor's version format; nvidia-open ships the nvidia-persistenced unit the role enables (on a
# real node it comes with the driver's utilities), fabric manager its own unit.
GPU_KERNEL = "6.8.0-49-generic"  # rlm_kernel: the packages named after it are stand-ins too
NV_DRIVERS = ("550.127.08", "550.144.03")
NV_NCCL = ("2.21.5-1+cuda12.4", "2.22.3-1+cuda12.4")
NV_DRIVER_PACKAGES = ("nvidia-open-550", "nvidia-fabricmanager-550")
NV_NCCL_PACKAGES = ("libnccl2", "libnccl-dev")


def nvidia_stand_ins() -> list[StandIn]:
    units = {
        "nvidia-open-550": ("nvidia-persistenced",),
        "nvidia-fabricmanager-550": ("nvidia-fabricmanager",),
    }
    return (
        [
            StandIn(name, f"{driver}-1", units=units[name])
            for driver in NV_DRIVERS
            for name in NV_DRIVER_PACKAGES
        ]
        + [StandIn(name, nccl) for nccl in NV_NCCL for name in NV_NCCL_PACKAGES]
        + [StandIn("cuda-nvcc-12-4", "12.4.131-1"), StandIn(f"linux-headers-{GPU_KERNEL}", "1")]
    )


def gpu_driver_playbook(node: Node, name: str, role: str) -> Path:
    """A playbook that runs gpu_detect and the vendor's driver role on the node."""
    play = {
        "name": "GPU drivers",
        "hosts": "mgmt",
        "gather_facts": True,
        "gather_subset": ["min"],
        "roles": ["gpu_detect", role],
    }
    return node.playbook(name, [play])


def test_a_gpu_driver_and_nccl_bump_converges_and_the_pin_holds_apt(node: Node) -> None:
    key = SigningKey(node.work / "gnupg")
    base = node.rig.shared_dir / "vendor" / "cuda"
    # The site's mirror of developer.download.nvidia.com/compute/cuda/repos, same layout.
    write_flat_repo(base / "ubuntu2204/x86_64", nvidia_stand_ins(), key, node.work / "debs")
    playbook = gpu_driver_playbook(node, "gpu", "gpu_nvidia")
    site = {
        # An Ubuntu 22.04 H100 node as the role sees it; the rig's bookworm userland installs.
        "rlm_gpu_vendor": "nvidia",
        "rlm_gpus_per_node": 8,
        "rlm_distribution_version": "22.04",
        "rlm_kernel": GPU_KERNEL,
        "rlm_allow_reboot": False,
        "gpu_nvidia_fabricmanager": True,
        "gpu_nvidia_repo_base": f"file:{base}",
        "gpu_nvidia_repo_key_src": str(key.public),
    }

    def apply(driver: str, nccl: str) -> PlaybookRun:
        pins = {"gpu_nvidia_driver_version": driver, "gpu_nvidia_nccl_version": nccl}
        run = node.apply(playbook, {**site, **pins})
        # No GPU driver loads on the rig: the role says so and ends non-failed.
        report = run.task(node.host.name, "Report the pending reboot").result["msg"]
        assert "reboot required (driver nvidia-open-550 " + driver in report, report
        return run

    def installed() -> dict[str, str]:
        names = NV_DRIVER_PACKAGES + NV_NCCL_PACKAGES
        lines = node.sh("dpkg-query -W -f '${Package} ${Version}\\n' " + " ".join(names))
        return dict(line.split(" ", 1) for line in lines.splitlines())

    def expected(driver: str, nccl: str) -> dict[str, str]:
        return {
            **{name: f"{driver}-1" for name in NV_DRIVER_PACKAGES},
            **{name: nccl for name in NV_NCCL_PACKAGES},
        }

    node.sh("apt-get update -qq")
    apply(NV_DRIVERS[0], NV_NCCL[0])
    assert installed() == expected(NV_DRIVERS[0], NV_NCCL[0])
    assert node.sh("systemctl is-enabled nvidia-persistenced nvidia-fabricmanager").split() == [
        "enabled",
        "enabled",
    ]

    # The pins hold apt: an unattended upgrade (the newer versions are in the mirror) moves nothing.
    node.sh("DEBIAN_FRONTEND=noninteractive apt-get -y -qq upgrade")
    assert installed() == expected(NV_DRIVERS[0], NV_NCCL[0])

    bumped = apply(NV_DRIVERS[1], NV_NCCL[1])
    assert bumped.task(node.host.name, "Install the NVIDIA driver").changed
    assert bumped.task(node.host.name, "Install NCCL").changed
    assert installed() == expected(NV_DRIVERS[1], NV_NCCL[1])

    again = apply(NV_DRIVERS[1], NV_NCCL[1])
    assert again.stats(node.host.name)["changed"] == 0, again.changed(node.host.name)


# AMD: amdgpu-dkms from repo.radeon.com/amdgpu/<release>/ubuntu and the ROCm runtime, RCCL, SMI
# libraries and hipcc + rccl-dev from repo.radeon.com/rocm/apt/<release>, one versioned repository
# per release (the role's pin: gpu_amd_rocm_version picks the URLs). Stand-ins, two real releases,
# versions in AMD's format (<component version>.<ROCm build>-<build>~22.04); the kernel headers and
# extra modules come from the distribution, so their stand-ins sit in a third repository.
AMD_RELEASES = {"6.2.4": "60204-139~22.04", "6.3.1": "60301-48~22.04"}
AMD_COMPONENTS = {  # package -> its own version in each release
    "rocm-hip-runtime": ("6.2.4", "6.3.1"),
    "rccl": ("2.20.5", "2.21.5"),
    "rccl-dev": ("2.20.5", "2.21.5"),
    "rocminfo": ("1.0.0", "1.0.0"),
    "amd-smi-lib": ("24.6.3", "24.7.1"),
    "rocm-smi-lib": ("7.3.0", "7.4.0"),
    "hipcc": ("1.1.1", "1.1.1"),
}
AMD_DKMS = {"6.2.4": "1:6.8.5.60204-2071555.22.04", "6.3.1": "1:6.10.5.60301-2109964.22.04"}


def amd_versions(release: str) -> dict[str, str]:
    index = list(AMD_RELEASES).index(release)
    return {
        "amdgpu-dkms": AMD_DKMS[release],
        **{
            name: f"{versions[index]}.{AMD_RELEASES[release]}"
            for name, versions in AMD_COMPONENTS.items()
        },
    }


def test_a_rocm_and_amdgpu_bump_converges_and_the_pin_holds_apt(node: Node) -> None:
    key = SigningKey(node.work / "gnupg-amd")
    base = node.rig.shared_dir / "vendor" / "radeon"
    debs = node.work / "debs-amd"
    for release in AMD_RELEASES:
        versions = amd_versions(release)
        dkms = [StandIn("amdgpu-dkms", versions.pop("amdgpu-dkms"))]
        runtime = [StandIn(name, version) for name, version in versions.items()]
        # The site's mirror of repo.radeon.com, same layout.
        write_suite_repo(base / "amdgpu" / release / "ubuntu", "jammy", dkms, key, debs)
        write_suite_repo(base / "rocm/apt" / release, "jammy", runtime, key, debs)
    kernel = [
        StandIn(f"{kind}-{GPU_KERNEL}", "1") for kind in ("linux-headers", "linux-modules-extra")
    ]
    distribution = node.rig.shared_dir / "vendor" / "ubuntu"
    write_flat_repo(distribution, kernel, key, debs)
    node.sh(
        f"echo 'deb [trusted=yes] file:{distribution} ./' > /etc/apt/sources.list.d/ubuntu.list"
        " && apt-get update -qq"
    )
    playbook = gpu_driver_playbook(node, "gpu-amd", "gpu_amd")
    site = {
        # An Ubuntu 22.04 MI300X node as the role sees it; the rig's bookworm userland installs.
        "rlm_gpu_vendor": "amd",
        "rlm_gpus_per_node": 8,
        "rlm_distribution_release": "jammy",
        "rlm_distribution_version": "22.04",
        "rlm_kernel": GPU_KERNEL,
        "rlm_allow_reboot": False,
        "gpu_amd_repo_base": f"file:{base}",
        "gpu_amd_repo_key_src": str(key.public),
    }
    names = list(amd_versions("6.2.4"))

    def apply(release: str) -> PlaybookRun:
        run = node.apply(playbook, {**site, "gpu_amd_rocm_version": release})
        report = run.task(node.host.name, "Report the pending reboot").result["msg"]
        assert "reboot required (driver amdgpu-dkms " + release in report, report
        return run

    def installed() -> dict[str, str]:
        lines = node.sh("dpkg-query -W -f '${Package} ${Version}\\n' " + " ".join(names))
        return dict(line.split(" ", 1) for line in lines.splitlines())

    first, second = AMD_RELEASES
    apply(first)
    assert installed() == amd_versions(first)
    # The role's pin (priority 600, ahead of the distribution's ROCm builds) applies to the mirror.
    policy = node.sh("apt-cache policy rccl")
    assert re.search(r"^ +600 file:.*/rocm/apt/6\.2\.4 jammy/main", policy, re.M), policy

    # The pin holds apt: the next release is in the mirror, but not in the versioned repository.
    node.sh("DEBIAN_FRONTEND=noninteractive apt-get -y -qq upgrade")
    assert installed() == amd_versions(first)

    bumped = apply(second)
    assert bumped.task(node.host.name, "Install the amdgpu kernel driver").changed
    assert bumped.task(node.host.name, "Install the ROCm runtime and RCCL").changed
    assert installed() == amd_versions(second)

    again = apply(second)
    assert again.stats(node.host.name)["changed"] == 0, again.changed(node.host.name)

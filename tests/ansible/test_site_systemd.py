"""site.yml on bare systemd nodes, as a new user meets it: a mgmt node and two compute nodes of
Debian 12 in the example inventory's shape, and a one-node Debian 13 site whose node is both mgmt
and compute (tests/rig/booted.py); vendor none, no Lustre.

The nodes start with what the first runs on real nodes tripped over: no service user, no chrony, no
nftables, no python3-packaging, and a cloud image's `50-cloud-init.conf` turning password login on.
One rig for the module: check mode, first run, rerun, then checks (units, sshd, the sandboxed
unprivileged rlm-exporter, the trainer and user slices and a trainer start in the slice, who
reaches the exporters, Prometheus and Alertmanager); the reboot test comes last.

The air-gapped site (its own section below): preflight names what a node cannot fetch; verify.yml
and `rlmctl health` give one verdict on the shared directory. With RLM_TEST_FULL_WHEELHOUSES=1,
one more compute node of each release (node4, Debian 12; node6, Debian 13) installs torch, the
bundle and every dependency from full wheelhouses built by `rlmctl wheelhouse` for their Python (cp311: 262 MiB, cp313: 2.7 GB of
PyPI's CUDA torch and its nvidia-* wheels), offline, and a short training runs on node6. That adds
about 20-25 min to the module on a fresh 2-core machine (two builds, the wheels copied to the nodes,
torch installed twice), so `make test` leaves it out; `make test-wheelhouses` runs it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paramiko
import pytest
import yaml

from rlmctl import accept, hostproc
from rlmctl.backend_ssh import host_start_config
from rlmctl.inventory import load as load_inventory
from tests.ansible.playbook_run import REPO, PlaybookRun, run_playbook, write_inventory
from tests.ansible.rig_site import VENV, connect, connect_from_real_host
from tests.ansible.systemd_site import (
    SLICE_LIMITS,
    build_offline_stacks,
    full_wheelhouse,
    site_inventory,
)
from tests.monitoring import alerting_site
from tests.rig import Rig
from tests.rlmctl.conftest import rlmctl
from tests.slurm.slurm_rig import prepare_corpus
from tests.test_rig_systemd import systemd_unavailable
from trainer.rundir import RunDir

# Opt-in (see above): the full wheelhouses, their offline installs and the Debian 13 training.
FULL_WHEELHOUSES = os.environ.get("RLM_TEST_FULL_WHEELHOUSES") == "1"
needs_full_wheelhouses = pytest.mark.skipif(
    not FULL_WHEELHOUSES, reason="RLM_TEST_FULL_WHEELHOUSES=1 (make test-wheelhouses) runs it"
)
# The module's fixture runs site.yml three times on 4 nodes (6 with the full wheelhouses); with
# the full wheelhouses it builds two of them (cached until the bundle changes) first.
pytestmark = [pytest.mark.rig, pytest.mark.timeout(7200 if FULL_WHEELHOUSES else 3600)]
SLOT = 6  # see docs/rig.md for the slots of each module
# Debian 12: a mgmt node and two compute nodes (the alerting tests need a quiet one beside the
# one they break); Debian 13: one node, mgmt and compute (a one-node site: a separate mgmt node
# of its own cost every site.yml run ~240 more tasks, a fifth of the module's provisioning).
# The full wheelhouses add a compute node per release for their installs.
BOOKWORM_NODES = 4 if FULL_WHEELHOUSES else 3
TRIXIE_NODES = 2 if FULL_WHEELHOUSES else 1
RELEASES = ["bookworm"] * BOOKWORM_NODES + ["trixie"] * TRIXIE_NODES
MGMT = ("node1", f"node{BOOKWORM_NODES + 1}")
# The Debian 12 and Debian 13 nodes that install everything from the full wheelhouses (opt-in).
BOOKWORM_OFFLINE, TRIXIE_OFFLINE = f"node{BOOKWORM_NODES}", f"node{len(RELEASES)}"
# The Debian 13 mgmt node, a compute node too when it is the release's only one (without the full
# wheelhouses); the preflight test breaks its sources.
TRIXIE_SPARE = MGMT[1]
# A Debian 13 compute node: the last node (the one-node site's; the offline one with the full
# wheelhouses).
TRIXIE_COMPUTE = f"node{len(RELEASES)}"
PASSWORD = "Rig-password-1"  # of a throwaway account on throwaway nodes
CLOUD_INIT_SSHD = "/etc/ssh/sshd_config.d/50-cloud-init.conf"
EVERY_NODE_UNITS = ("ssh", "nftables", "prometheus-node-exporter", "rlm-exporter")
MGMT_UNITS = ("prometheus", "prometheus-alertmanager")
EXPORTER_UID = 9410  # rlm_exporter_uid's default
SERVICE_UID = 2000  # users_ssh_service_uid's default
# Compute nodes that take torch and everything else from a full wheelhouse for their Python.
OFFLINE = {BOOKWORM_OFFLINE: "3.11", TRIXIE_OFFLINE: "3.13"} if FULL_WHEELHOUSES else {}
SANDBOX = {
    "User": "rlm-exporter",
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
}


@dataclass
class Site:
    rig: Rig
    inventory: Path
    password_login_before: dict[str, bool]
    check: PlaybookRun
    first: PlaybookRun
    second: PlaybookRun
    wheelhouses: dict[str, Path]  # node -> its full wheelhouse (OFFLINE)


def timed(what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), printing how long it took and the machine's load."""
    started = time.monotonic()
    try:
        return fn(*args, **kwargs)
    finally:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"\n{what}: {time.monotonic() - started:.0f} s (load {load})", flush=True)


def password_login(ip: str) -> bool:
    """Whether sshd on `ip` accepts a password login, tried over the wire."""
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # throwaway nodes
    try:
        client.connect(
            ip, username="tester", password=PASSWORD, look_for_keys=False, allow_agent=False
        )
        return True
    except paramiko.AuthenticationException:
        return False
    finally:
        client.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    if reason := systemd_unavailable():
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("site-systemd")
    with Rig(len(RELEASES), slot=SLOT, release=RELEASES) as rig:
        for host in rig.hosts:
            rig.exec(
                host,
                f"printf 'PasswordAuthentication yes\\n' > {CLOUD_INIT_SSHD}; "
                f"useradd -m -s /bin/bash tester && echo 'tester:{PASSWORD}' | chpasswd; "
                "systemctl reload ssh.service",
            )
        before = {h.name: password_login(h.ip) for h in rig.hosts}
        # A runs/ made by root before provisioning (a site's own mkdir, an earlier tool).
        (rig.shared_dir / "runs").mkdir()
        wheelhouse, stacks = build_offline_stacks(rig, work)
        full = {
            name: timed(f"wheelhouse cp{python}", full_wheelhouse, python)
            for name, python in OFFLINE.items()
        }
        inventory = write_inventory(
            work / "hosts.yml", site_inventory(rig, wheelhouse, stacks, full)
        )
        check = timed(
            "check run", run_playbook, "site.yml", inventory, work, check=True, timeout=1800
        )
        first = timed("first run", run_playbook, "site.yml", inventory, work, timeout=2400)
        second = (
            timed("rerun", run_playbook, "site.yml", inventory, work, timeout=1800)
            if first.rc == 0
            else first
        )
        yield Site(rig, inventory, before, check, first, second, full)


def test_check_mode_on_bare_nodes_completes_and_plans_every_play(site: Site) -> None:
    for host in site.rig.hosts:
        assert site.check.failures(host.name) == [], host.name
        # Planned, not stopped early in the base play: packages, firewall, trainer, exporters.
        for task in ("Install base packages (apt)", "Install nftables", "Run rlm-exporter"):
            assert site.check.ran(host.name, task), (host.name, task)
    for name in MGMT:
        assert site.check.ran(name, "Install Prometheus")
    assert site.check.rc == 0, site.check.stderr[-2000:]


def test_first_run_completes_and_a_rerun_changes_nothing(site: Site) -> None:
    for host in site.rig.hosts:
        assert site.first.failures(host.name) == [], host.name
    assert site.first.rc == 0, site.first.stderr[-2000:]
    for host in site.rig.hosts:
        assert site.second.stats(host.name)["changed"] == 0, site.second.changed(host.name)
    assert site.second.rc == 0


def test_password_login_is_refused_despite_cloud_init(site: Site) -> None:
    assert all(site.password_login_before.values()), site.password_login_before  # reproduced
    for host in site.rig.hosts:
        effective = site.rig.exec(host, "sshd -T | grep -i '^passwordauthentication'").stdout
        assert effective.strip() == "passwordauthentication no", host.name
        assert site.rig.exec(host, f"test -f {CLOUD_INIT_SSHD}").returncode == 0  # left alone
        assert not password_login(host.ip), host.name


def units_of(name: str) -> tuple[str, ...]:
    return EVERY_NODE_UNITS + (MGMT_UNITS if name in MGMT else ())


def assert_units_up(rig: Rig) -> None:
    for host in rig.hosts:
        units = units_of(host.name)
        enabled = rig.exec(host, ["systemctl", "is-enabled", *units], check=False).stdout.split()
        active = rig.exec(host, ["systemctl", "is-active", *units], check=False).stdout.split()
        assert dict(zip(units, enabled, strict=True)) == dict.fromkeys(units, "enabled"), host.name
        assert dict(zip(units, active, strict=True)) == dict.fromkeys(units, "active"), host.name
        # chrony is enabled; it cannot start in a node without CAP_SYS_TIME (ConditionCapability),
        # which nodes must not get: the real host keeps the clock (docs/rig.md).
        chrony = rig.exec(
            host, "systemctl is-enabled chrony; systemctl show -P ConditionResult chrony"
        ).stdout.split()
        assert chrony == ["enabled", "no"], host.name


def assert_firewall_and_sysctls_in_force(rig: Rig) -> None:
    for host in rig.hosts:
        ruleset = rig.exec(host, "nft list table inet rlm").stdout
        assert "policy drop" in ruleset, host.name
        # Per-namespace keys of common_sysctl, loaded by systemd-sysctl at boot.
        sysctls = rig.exec(
            host, "sysctl -n net.ipv4.conf.all.arp_ignore net.ipv4.conf.all.arp_announce"
        )
        assert sysctls.stdout.split() == ["1", "2"], host.name


def test_every_installed_unit_is_enabled_and_active(site: Site) -> None:
    assert site.first.rc == 0
    assert_units_up(site.rig)
    for host in site.rig.hosts:
        assert "policy drop" in site.rig.exec(host, "nft list table inet rlm").stdout


def scrape(rig: Rig, host_name: str, address: str) -> str:
    """GET /metrics of rlm-exporter from inside the node; the error's type name when refused."""
    code = (
        "import sys, urllib.request\n"
        "try:\n"
        "    print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())\n"
        "except OSError as error:\n"
        "    print(type(getattr(error, 'reason', error)).__name__)\n"
    )
    url = f"http://{address}:9410/metrics"
    return rig.exec(host_name, ["/usr/bin/python3", "-c", code, url]).stdout


def test_rlm_exporter_runs_unprivileged_sandboxed_on_the_cluster_address(site: Site) -> None:
    assert site.first.rc == 0
    rig = site.rig
    # A run directory on the shared dir, which lies under /var/tmp on the rig: PrivateTmp would
    # hide it unless the unit binds it back in.
    run = rig.shared_dir / "runs" / "sandbox-probe"
    run.mkdir(parents=True, exist_ok=True)
    status = {"state": "running", "step": 7, "updated": time.time()}
    (run / "status.json").write_text(json.dumps(status))
    assert rig.shared_dir.stat().st_uid == SERVICE_UID  # the pinned service user owns it
    for host in rig.hosts:
        props = rig.exec(
            host, ["systemctl", "show", "rlm-exporter", *(f"--property={p}" for p in SANDBOX)]
        ).stdout
        assert dict(line.split("=", 1) for line in props.split()) == SANDBOX, host.name
        pid = rig.exec(host, "systemctl show -P MainPID rlm-exporter").stdout.strip()
        proc_status = rig.exec(host, f"cat /proc/{pid}/status").stdout
        uids = next(
            line.split()[1:] for line in proc_status.splitlines() if line.startswith("Uid:")
        )
        assert uids == [str(EXPORTER_UID)] * 4, (host.name, uids)
        device_gids = rig.exec(host, "getent group video render | cut -d: -f3").stdout.split()
        groups = next(
            line.split()[1:] for line in proc_status.splitlines() if line.startswith("Groups:")
        )
        assert device_gids and set(device_gids) <= set(groups), (host.name, groups)
        # Bound to the cluster address only.
        assert scrape(rig, host.name, "127.0.0.1") == "ConnectionRefusedError\n", host.name
        deadline = time.monotonic() + 60  # the exporter reads runs every rlm_exporter_interval_s
        while 'rlm_run_step{run="sandbox-probe"} 7.0' not in (
            metrics := scrape(rig, host.name, host.ip)
        ):
            assert time.monotonic() < deadline, (host.name, metrics[-2000:])
            time.sleep(1)


def show(rig: Rig, host_name: str, unit: str, *properties: str) -> dict[str, str]:
    argv = ["systemctl", "show", unit, *(f"--property={p}" for p in properties)]
    out = rig.exec(host_name, argv).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def test_trainer_slice_and_user_slices_have_the_site_limits(site: Site) -> None:
    assert site.first.rc == 0
    limits = SLICE_LIMITS
    for host in site.rig.hosts:
        trainer = show(
            site.rig, host.name, "rlm-trainer.slice", "MemoryMax", "CPUWeight", "TasksMax"
        )
        assert trainer == {
            "MemoryMax": str(limits["rlm_trainer_memory_max_bytes"]),
            "CPUWeight": str(limits["rlm_trainer_cpu_weight"]),
            "TasksMax": limits["rlm_trainer_tasks_max"],
        }, host.name
        # Any uid's slice takes the user-.slice drop-in, logged in or not.
        user = show(site.rig, host.name, "user-4242.slice", "MemoryMax", "CPUWeight", "TasksMax")
        assert user == {
            "MemoryMax": str(limits["rlm_user_memory_max_bytes"]),
            "CPUWeight": str(limits["rlm_user_cpu_weight"]),
            "TasksMax": limits["rlm_user_tasks_max"],
        }, host.name


def hostproc_call(rig: Rig, host_name: str, script: str, action: str, cfg: dict) -> dict:
    """The host-side script as rlmctl ships it: the node's python3, one base64 JSON argument."""
    payload = base64.b64encode(json.dumps(cfg).encode()).decode()
    out = rig.exec(host_name, ["/usr/bin/python3", script, action, payload]).stdout
    return json.loads(out.splitlines()[-1])


def test_rlmctl_starts_the_trainer_in_its_own_unit_of_the_slice(site: Site) -> None:
    """hostproc's start on a systemd host: a transient unit in rlm-trainer.slice with
    Delegate=yes; status and stop find the run's processes in it; the exit code is recorded."""
    assert site.first.rc == 0
    rig = site.rig
    script = rig.shared_dir / "hostproc.py"
    shutil.copy(hostproc.__file__, script)
    run_dir = rig.shared_dir / "runs" / "slice-probe"
    run_dir.mkdir(parents=True, exist_ok=True)
    inventory = load_inventory(site.inventory)
    for host in (rig.host("node2"), rig.host(TRIXIE_COMPUTE)):  # a compute node of each release
        ident = {"run_dir": str(run_dir), "host": host.name}
        # What `rlmctl launch` sends, with a worker in a session of its own (as torchrun's
        # are) instead of the trainer.
        argv = ["/bin/sh", "-c", "setsid sleep 300 & sleep 300"]
        cfg = host_start_config(inventory.hosts[host.name], RunDir(run_dir), argv)
        exit_file = Path(cfg["exit_file"])
        exit_file.parent.mkdir(parents=True, exist_ok=True)
        started = hostproc_call(rig, host.name, str(script), "start", cfg)
        assert started["slice"] == "rlm-trainer.slice", started
        unit = show(rig, host.name, started["unit"], "Slice", "Delegate", "MainPID", "ActiveState")
        assert unit == {
            "Slice": "rlm-trainer.slice",
            "Delegate": "yes",
            "MainPID": str(started["pid"]),
            "ActiveState": "active",
        }, (host.name, unit)
        deadline = time.monotonic() + 30
        while (
            len(
                (state := hostproc_call(rig, host.name, str(script), "status", ident | started))[
                    "processes"
                ]
            )
            < 4
        ):
            assert time.monotonic() < deadline, state  # launcher, sh, sleep, setsid'd sleep
            time.sleep(0.2)
        assert state["alive"], state
        stopped = hostproc_call(
            rig, host.name, str(script), "stop", ident | started | {"timeout": 20}
        )
        assert stopped["remaining"] == [] and stopped["found"] >= 4, stopped
        after = hostproc_call(rig, host.name, str(script), "status", ident | started)
        assert after == {"alive": False, "processes": []}, after
        assert "exit_code" in json.loads(exit_file.read_text())


def test_prometheus_and_alertmanager_answer_only_mgmt_and_admin_sources(site: Site) -> None:
    assert site.first.rc == 0
    rig = site.rig
    for mgmt_name in MGMT:
        mgmt = rig.host(mgmt_name)
        # A compute node of the cluster (the one-node Debian 13 site has no other of its own).
        compute = next(h for h in rig.hosts if h.name not in MGMT)
        for port in (9090, 9093):
            # The controller is in rlm_admin_sources; the mgmt host reaches its own address.
            assert connect_from_real_host(mgmt.ip, port) == "open", (mgmt_name, port)
            assert connect(rig, mgmt_name, mgmt.ip, port) == "open", (mgmt_name, port)
            # A compute node is dropped (no answer at all), as every other source would be.
            from_compute = connect(rig, compute.name, mgmt.ip, port)
            assert from_compute == "TimeoutError", (compute.name, port, from_compute)


def test_exporter_ports_answer_only_mgmt_and_other_ports_only_cluster_members(site: Site) -> None:
    """node_exporter and rlm-exporter answer the mgmt node and drop another compute node; a port
    the trainer uses (rendezvous, collectives) is open between cluster members and closed to the
    real host, which is not in the inventory; SSH is open to everyone."""
    assert site.first.rc == 0
    rig = site.rig
    node2 = rig.host("node2").ip
    for port in (9100, 9410):
        assert connect(rig, "node1", node2, port) == "open", port
        assert connect(rig, "node3", node2, port) == "TimeoutError", port
    rig.exec("node2", "setsid /usr/bin/python3 -m http.server 29500 >/dev/null 2>&1 < /dev/null &")
    try:
        deadline = time.monotonic() + 10
        while connect(rig, "node3", node2, 29500) != "open":
            assert time.monotonic() < deadline, "listener on node2:29500 not reachable from node3"
        assert connect_from_real_host(node2, 29500) == "TimeoutError"
        assert connect_from_real_host(node2, 22) == "open"
    finally:
        rig.exec("node2", "pkill -f 'http.server 29500'", check=False)


# ------------------------------------------------------------------------------------------------
# The air-gapped site: full wheelhouses, preflight, one verdict on the shared directory, Debian 13.
# Self-contained: these tests use the module's nodes and inventory, and leave them as they were.

# torch as installed, by its distribution version, which is what a manifest names: PyPI's CUDA
# build says 2.13.0 there and 2.13.0+cu130 in torch.__version__ (the CPU index's says +cpu in both).
VENV_REPORT = (
    "import importlib.metadata as m, json, sys, torch\n"
    "x = torch.ones(8, 8)\n"
    "print(json.dumps({'python': '%d.%d' % sys.version_info[:2], 'torch': m.version('torch'),"
    " 'product': float((x @ x).sum()), 'bundle': m.version('rlm-ops')}))\n"
)


def loop_items(run: PlaybookRun, host: str, task: str) -> list[dict]:
    """The items of a loop task that ran (not skipped) on `host`."""
    if not run.ran(host, task):
        return []
    return [i for i in run.task(host, task).result.get("results", []) if not i.get("skipped")]


@needs_full_wheelhouses
def test_full_wheelhouses_install_offline_and_a_rerun_reads_only_their_manifests(
    site: Site,
) -> None:
    """A Debian 12 and a Debian 13 node (no route to any index) install torch, the bundle
    and every [train] dependency from the wheelhouse built for their Python; the first run copies
    every wheel and pip checks each hash; the rerun compares manifests and copies nothing."""
    assert site.first.rc == 0
    for name, python in OFFLINE.items():
        manifest = json.loads((site.wheelhouses[name] / "manifest.json").read_text())
        assert manifest["target"]["python"] == python
        wheels = {w["file"] for w in manifest["wheels"]}
        copied = {
            i["item"]["file"]
            for i in loop_items(site.first, name, "Copy the wheels the node lacks")
        }
        assert copied == wheels, (name, wheels ^ copied)
        assert site.first.task(name, "Install torch and the bundle from the wheelhouse").changed
        out = site.rig.exec(name, [f"{VENV}/bin/python", "-c", VENV_REPORT]).stdout
        report = json.loads(out.splitlines()[-1])
        assert report == {
            "python": python,
            "torch": manifest["torch"],
            "product": 512.0,
            "bundle": manifest["bundle"]["version"],
        }, (name, report)
        # The rerun read the node's manifest and the venv's record of it, no wheel.
        assert not site.second.ran(name, "Bring the node's wheelhouse to the controller's manifest")
        assert not site.second.ran(name, "Install torch and the bundle from the wheelhouse")
    # The builder verified the cp311 one in a clean venv of Python 3.11 before moving it into place.
    cp311 = site.wheelhouses[BOOKWORM_OFFLINE]
    verified = json.loads((cp311 / "manifest.json").read_text())["verified"]
    assert verified["python"].startswith("3.11.") and verified["torch"].startswith("2.13.0")


def test_preflight_names_what_a_node_cannot_fetch_and_changes_nothing(
    site: Site, tmp_path: Path
) -> None:
    """A Debian 13 node given no wheelhouse (the PyTorch index, unreachable from the rig) and an
    apt source no mirror answers; with the full wheelhouses, another (Python 3.13) given the
    Debian 12 one. Each node's one line says what it cannot have and how to provide it."""
    assert site.first.rc == 0
    rig = site.rig
    inventory = yaml.safe_load(site.inventory.read_text())
    hosts = inventory["all"]["hosts"]
    spare, offline, cp311 = TRIXIE_SPARE, TRIXIE_OFFLINE, site.wheelhouses.get(BOOKWORM_OFFLINE)
    limit = [spare]
    if FULL_WHEELHOUSES:
        hosts[offline] |= {"rlm_wheelhouse": str(cp311)}
        limit.append(offline)
    hosts[spare] |= {"rlm_wheelhouse": "", "trainer_env_torch_source": "index"}
    gone = f"http://{rig.layout.bridge_ip}:9/debian"  # the real host: nothing listens on 9
    sources = "/etc/apt/sources.list.d/gone-mirror.list"
    rig.exec(spare, f"echo 'deb [trusted=yes] {gone} trixie main' > {sources}")
    try:
        run = run_playbook(
            "site.yml",
            write_inventory(tmp_path / "hosts.yml", inventory),
            tmp_path,
            limit=",".join(limit),
            timeout=600,
        )
    finally:
        rig.exec(spare, f"rm -f {sources}")
    assert run.rc != 0
    if FULL_WHEELHOUSES:
        [wrong_python] = run.failures(offline)
        assert (
            f"{offline}: rlm_wheelhouse={cp311} is built for Python 3.11 (cp311), "
            "this node's venv Python is 3.13: build one for this node with `rlmctl wheelhouse "
            "--python 3.13 --vendor none --glibc 2.41 --out DIR (on a connected machine)` and set "
            "rlm_wheelhouse to it for these nodes" in wrong_python
        ), wrong_python
    [unreachable] = run.failures(spare)
    assert unreachable.startswith(
        f"common : Stop on a source this node cannot reach: {spare} cannot"
    ), unreachable
    assert (
        "Python index https://download.pytorch.org/whl/cpu/torch/ (" in unreachable
        and "): build a wheelhouse for this node on a connected machine (`rlmctl wheelhouse "
        "--python 3.13 --vendor none --glibc 2.41 --out DIR`) and set rlm_wheelhouse=DIR"
        in unreachable
    ), unreachable
    assert (
        f"apt source {gone}/dists/trixie/InRelease (Connection refused): point the node's apt "
        "sources at a reachable mirror" in unreachable
    ), unreachable
    assert {r.play for r in run.results} == {"Validate variables before any change"}
    assert all(run.changed(host) == [] for host in limit)


def disk_verdicts(site: Site, hosts: list[str], work: Path) -> dict[str, tuple[dict, dict]]:
    """Per host, the shared directory's verdict from playbooks/verify.yml and from `rlmctl
    health` (its disk check), GiB figures masked (the free space moves between the two)."""

    def masked(check: dict) -> dict:
        keep = {k: check[k] for k in ("state", "detail", "fix")}
        return keep | {"detail": re.sub(r"[0-9.]+ GiB free", "N GiB free", keep["detail"])}

    verify = run_playbook("verify.yml", site.inventory, work, limit=",".join(hosts))
    health = rlmctl("-i", str(site.inventory), "--limit", ",".join(hosts), "health", "--json")
    assert "Traceback" not in health.stderr, health.stderr
    report = {h["host"]: h for h in json.loads(health.stdout)["hosts"]}
    out = {}
    for host in hosts:
        played = json.loads(
            verify.task(host, "Judge the shared directory on the node").result["stdout"]
        )
        checked = next(c for c in report[host]["checks"] if c["name"] == "disk")
        out[host] = (masked(played), masked(checked))
    return out


def test_verify_and_health_give_one_verdict_on_the_shared_directory(
    site: Site, tmp_path: Path
) -> None:
    """A pre-existing root-owned runs/ was given to the service user by the first run. Made
    root's again, verify.yml and `rlmctl health` both call the directory CRIT with the same line
    and the same advice for rlm_shared_fs: none (the role's fix, not a mount); the advised
    `site.yml --tags users_ssh` gives it back, and both say OK."""
    assert site.first.rc == 0
    runs = site.rig.shared_dir / "runs"
    # Debian 12 and 13, each with torch in its venv (Debian 13's from the cp313 wheelhouse).
    hosts = ["node2", TRIXIE_OFFLINE] if FULL_WHEELHOUSES else ["node2", "node3"]
    assert runs.stat().st_uid == SERVICE_UID
    os.chown(runs, 0, 0)
    try:
        broken = disk_verdicts(site, hosts, tmp_path)
        for host, (played, checked) in broken.items():
            assert played == checked, (host, played, checked)
            assert played["state"] == "CRIT"
            # root's runs/ (mode 0755): the service user cannot create runs there either.
            assert played["detail"] == (
                f"{runs} is owned by root, not rlm; rlm cannot write in {runs}: Permission denied"
            ), played
            assert played["fix"] == (
                f"chown rlm: {runs} (site.yml does it: --tags users_ssh gives "
                f"{site.rig.shared_dir} and its runs/ to the service user)"
            ), played
        fixed = run_playbook(
            "site.yml", site.inventory, tmp_path, tags="users_ssh", limit="node2", timeout=600
        )
        assert fixed.rc == 0, fixed.failures("node2")
        assert runs.stat().st_uid == SERVICE_UID
        for host, (played, checked) in disk_verdicts(site, hosts, tmp_path).items():
            assert played == checked, (host, played, checked)
            assert played["state"] == "OK" and played["detail"].endswith("owned by rlm"), played
    finally:
        os.chown(runs, SERVICE_UID, SERVICE_UID)


@needs_full_wheelhouses
def test_a_short_training_runs_on_the_debian_13_node(site: Site) -> None:
    """The trainer from the Debian 13 offline node's venv (Python 3.13, torch from the cp313 wheelhouse) trains the
    tiny model to its last step, launched by rlmctl over SSH."""
    assert site.first.rc == 0
    prepare_corpus(site.rig, REPO)
    run = "debian13-tiny"
    argv = [
        "--limit",
        TRIXIE_OFFLINE,
        "launch",
        "--config",
        str(REPO / "trainer/configs/tiny.yaml"),
    ]
    argv += ["--name", run, "--nodes", "1", "data.path=data", "train.steps=8"]
    launched = rlmctl("-i", str(site.inventory), *argv, "metrics.log_every=1", timeout=240)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    deadline = time.monotonic() + 300
    while (status := rlmctl("-i", str(site.inventory), "status", run, "--json")).stdout.strip():
        state = json.loads(status.stdout)
        if state["state"] in ("done", "failed"):
            break
        assert time.monotonic() < deadline, state
        time.sleep(2)
    assert state["state"] == "done" and state["step"] == 8, state
    logs = rlmctl("-i", str(site.inventory), "logs", run, "-n", "200").stdout
    assert "step 8/8" in logs, logs[-2000:]


def test_after_a_reboot_units_firewall_and_sysctls_are_back(site: Site) -> None:
    assert site.first.rc == 0
    rig = site.rig
    started = time.monotonic()
    # Every node at once, as a cluster reboots; waits for each one's new PID 1 and the end of
    # its start-up.
    rig.reboot_all(rig.hosts, timeout=300)
    print(f"\n{len(rig.hosts)} nodes rebooted together in {time.monotonic() - started:.1f}s")
    assert_units_up(rig)
    assert_firewall_and_sysctls_in_force(rig)


# =================================================================================================
# Alerting end to end (issue 23) on the nodes above: the roles' own Prometheus, Alertmanager and
# rlm-exporter (units, users, sandbox, login, addresses), one more monitoring.yml run that sets
# receivers and a GPU host (tests/monitoring/alerting_site.py), durations divided by SCALE, then
# the faults an on-call engineer is paged for. Self-contained: only `site` is shared.
# =================================================================================================
ALERT_MGMT, GPU_HOST, QUIET_HOST = "node1", "node2", "node3"  # bookworm: mgmt, compute, compute
DELIVERY_S = alerting_site.DELIVERY_S


@pytest.fixture(scope="module")
def alerting(site: Site) -> Iterator[alerting_site.Alerting]:
    assert site.first.rc == 0
    rig = site.rig
    data = rig.shared_dir / "alerting-data"
    prepare_data = subprocess.Popen(
        [sys.executable, "-m", "trainer", "prepare", "--out", str(data)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    ctx = alerting_site.prepare(rig, site.inventory, ALERT_MGMT, GPU_HOST)
    try:
        assert ctx.deployed.rc == 0, {h: ctx.deployed.failures(h) for h in (ALERT_MGMT, GPU_HOST)}
        _, err = prepare_data.communicate(timeout=600)
        assert prepare_data.returncode == 0, err.decode()[-500:]
        ctx.hostproc = alerting_site.copy_hostproc(rig.shared_dir)
        ctx.trainer = alerting_site.start_trainer(rig, ctx.inventory, GPU_HOST, data, ctx.hostproc)
        yield ctx
    finally:
        prepare_data.kill()
        alerting_site.stop_trainer(ctx)
        ctx.webhook.close()


def test_monitoring_listens_on_the_cluster_address_and_answers_only_a_login(site: Site) -> None:
    """Closed by default: node_exporter, Prometheus and Alertmanager bind the node's own address,
    not every address; without the generated login nobody gets an answer, a compute node not
    even a connection; the login is in the inventory's group_vars, where rlmctl reads it."""
    assert site.first.rc == 0
    rig = site.rig
    for host in rig.hosts:
        listening = rig.exec(host, "ss -Hltn").stdout.split("\n")
        local = {line.split()[3] for line in listening if line.strip()}
        assert f"{host.ip}:9100" in local and "*:9100" not in local, (host.name, local)
        if host.name in MGMT:
            assert {f"{host.ip}:9090", f"{host.ip}:9093"} <= local, (host.name, local)
            assert not local & {"*:9090", "0.0.0.0:9090", "*:9093", "0.0.0.0:9093"}
    mgmt = rig.host(ALERT_MGMT)
    login = alerting_site.credentials(site.inventory)
    credentials_file = site.inventory.parent / "group_vars/all/rlm-monitoring-credentials.yml"
    assert credentials_file.stat().st_mode & 0o777 == 0o600
    for port, path in ((9090, "/api/v1/status/buildinfo"), (9093, "/api/v2/status")):
        url = f"http://{mgmt.ip}:{port}{path}"
        assert http_status(url) == 401  # the controller, in rlm_admin_sources, without the login
        assert http_status(url, ("rlm-ops", "wrong")) == 401
        assert http_status(url, login) == 200
        # The mgmt host itself without the login; a compute node gets no connection at all.
        assert "401" in rig.exec(ALERT_MGMT, ["/usr/bin/python3", "-c", STATUS, url]).stdout
        assert connect(rig, QUIET_HOST, mgmt.ip, port) == "TimeoutError"
    # rlmctl reads the same login from the inventory; accept's Prometheus client uses it.
    host = load_inventory(site.inventory).hosts[ALERT_MGMT]
    assert (host.monitoring_username, host.monitoring_password) == login
    api = accept.PrometheusAPI(f"http://{mgmt.ip}:9090", None, *login)
    assert accept.prom_query(api, "up{job='prometheus'}")[0]["value"][1] == "1"


# Prints the HTTP status of a GET (no login): run inside a node.
STATUS = (
    "import sys, urllib.error, urllib.request\n"
    "try:\n"
    "    print(urllib.request.urlopen(sys.argv[1], timeout=5).status)\n"
    "except urllib.error.HTTPError as error:\n"
    "    print(error.code)\n"
)


def http_status(url: str, login: tuple[str, str] | None = None) -> int:
    request = urllib.request.Request(url)
    if login:
        token = base64.b64encode(":".join(login).encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def report(timing: alerting_site.Timing) -> None:
    resolved = f"{timing.resolved_s:.1f} s" if timing.resolved_s is not None else "-"
    print(
        f"\n{timing.alert}: fault -> page {timing.page_s:.1f} s, recovery -> resolved {resolved}"
        f" (durations / {alerting_site.SCALE})"
    )


def test_an_xid_in_the_real_kernel_log_is_read_by_the_sandboxed_exporter_and_pages(
    alerting: alerting_site.Alerting,
) -> None:
    rig, node = alerting.rig, alerting.gpu_host
    # Reproduced: the exporter's user cannot read the kernel log (kernel.dmesg_restrict=1)...
    refused = rig.exec(node, ["runuser", "-u", "rlm-exporter", "--", "dmesg"], check=False)
    assert refused.returncode != 0 and "Operation not permitted" in refused.stderr, refused
    # ... its unit keeps CAP_SYSLOG alone, sandboxed, unprivileged.
    unit = show(rig, node, "rlm-exporter", "User", "AmbientCapabilities", "CapabilityBoundingSet")
    assert unit == {
        "User": "rlm-exporter",
        "AmbientCapabilities": "cap_syslog",
        "CapabilityBoundingSet": "cap_syslog",
    }, unit
    xid = f'rlm_gpu_xid_errors_total{{host="{node}", pci_bus="0000:5d:00", xid="79"}}'
    before = alerting_site.wait(
        lambda: alerting.prometheus.query(xid), DELIVERY_S, f"{xid} from the earlier line"
    )
    up = f'rlm_exporter_source_up{{host="{node}", source="dmesg"}}'
    assert alerting.prometheus.query(up)[0]["value"][1] == "1"
    timing = alerting_site.xid_in_the_kernel_log(alerting)
    after = float(alerting.prometheus.query(xid)[0]["value"][1])
    assert after == float(before[0]["value"][1]) + 1  # the line written through /dev/kmsg
    assert timing.labels["severity"] == "critical" and timing.labels["gpu"] == "3"
    report(timing)


def test_a_lost_gpu_pages_and_its_return_resolves(alerting: alerting_site.Alerting) -> None:
    timing = alerting_site.lost_gpu(alerting)
    assert timing.labels["severity"] == "critical"
    report(timing)
    # The run of the host's trainer, joined on (rlm:host_run, from the sandboxed exporter's
    # rlm_run_workers); what the join read when it is missing.
    assert timing.labels.get("run") == alerting_site.RUN, (timing.labels, joined_run(alerting))


def joined_run(alerting: alerting_site.Alerting) -> dict[str, list[dict[str, str]]]:
    queries = (
        f'rlm:host_run{{host="{alerting.gpu_host}"}}',
        "rlm_run_workers",
        f'rlm_trainer_processes{{host="{alerting.gpu_host}"}}',
    )
    return {q: [s["metric"] for s in alerting.prometheus.query(q)] for q in queries}


def test_a_stalled_trainer_pages_and_its_recovery_resolves(
    alerting: alerting_site.Alerting,
) -> None:
    timing = alerting_site.stalled_trainer(alerting)
    assert timing.labels["severity"] == "critical"
    report(timing)


def test_a_failed_run_pages_and_its_resume_resolves(alerting: alerting_site.Alerting) -> None:
    timing = alerting_site.failed_run(alerting)
    assert timing.labels["severity"] == "critical"
    report(timing)


def test_a_stopped_exporter_pages_and_its_restart_resolves(
    alerting: alerting_site.Alerting,
) -> None:
    timing = alerting_site.stopped_exporter(alerting, QUIET_HOST)
    assert timing.labels["severity"] == "warning"
    report(timing)


def test_the_watchdog_posts_every_five_minutes_scaled(alerting: alerting_site.Alerting) -> None:
    """The shipped Watchdog route, every duration / SCALE: a post every 10 s (+-1 s, the shipped
    5 min +-30 s, plus this machine's unscaled scheduling delay), measured at the dead-man's
    switch URL. The route shipped before skipped flushes: 20 s gaps."""
    period, tolerance = 300 / alerting_site.SCALE, alerting_site.WATCHDOG_TOLERANCE_S
    gaps = alerting_site.watchdog_gaps(alerting)
    print(f"\nWatchdog: {len(gaps)} gaps {min(gaps):.2f}-{max(gaps):.2f} s (expected {period:g} s)")
    assert all(abs(gap - period) <= tolerance for gap in gaps), gaps

"""The multi-host rig itself: isolation, SSH, Ansible, torchrun across hosts, teardown, CLI."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.rig import MAX_HOSTS, Rig
from tests.rig.layout import Layout
from tests.rig.processes import identify, is_running
from tests.rig.rig import PAUSE_ENV, leftovers, teardown
from trainer.rundir import read_json

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.prefix) / "bin"
PROBE = REPO / "tests" / "rig" / "allreduce_probe.py"
CLI_SLOT = 9  # the CLI tests' own slot: never the session rig's (0) or make_rig's (1, 2, ...)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.rig", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_three_hosts_come_up_quickly(rig: Rig) -> None:
    print(f"\n3-host rig brought up in {rig.bring_up_s:.2f}s")
    assert [h.name for h in rig.hosts] == ["node1", "node2", "node3"]
    assert rig.bring_up_s < 60


def test_each_host_has_its_own_hostname_and_address(rig: Rig) -> None:
    for host in rig.hosts:
        out = rig.exec(host, "hostname; ip -4 -o addr show dev eth0; ip -4 route").stdout
        name, address, *routes = out.splitlines()
        assert name == host.name
        assert f"inet {host.ip}/24" in address
        # No default route: nothing a host sends can leave the rig's subnet.
        assert routes == [f"{rig.layout.subnet} dev eth0 proto kernel scope link src {host.ip} "]
    assert len({h.ip for h in rig.hosts}) == 3


def test_every_host_reaches_every_other_by_name_with_strict_host_keys(rig: Rig) -> None:
    names = [h.name for h in rig.hosts]
    for source in rig.hosts:
        loop = "; ".join(f"ssh -o StrictHostKeyChecking=yes {n} hostname" for n in names)
        assert rig.ssh(source, loop).stdout.split() == names


def test_strict_host_key_checking_rejects_a_wrong_key(rig: Rig, tmp_path: Path) -> None:
    node2_with_node3_key = [
        line.replace("node3,", "node2,").replace(rig.hosts[2].ip, rig.hosts[1].ip)
        for line in rig.known_hosts_path.read_text().splitlines()
        if line.startswith("node3,")
    ]
    forged = tmp_path / "known_hosts"
    forged.write_text("\n".join(node2_with_node3_key) + "\n")
    result = subprocess.run(
        [
            "ssh",
            "-F",
            str(rig.ssh_config_path),
            "-o",
            f"UserKnownHostsFile={forged}",
            "node2",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 255
    assert "HOST IDENTIFICATION HAS CHANGED" in result.stderr


@pytest.mark.parametrize("directory", ["/etc", "/tmp", "/run"])
def test_files_written_in_a_host_stay_in_that_host(rig: Rig, directory: str) -> None:
    path = f"{directory}/rlm-rig-probe-{uuid.uuid4().hex}"
    node1, node2 = rig.hosts[:2]
    rig.exec(node1, f"echo node1 > {path}")
    try:
        assert rig.ssh(node1, f"cat {path}").stdout == "node1\n"
        assert (node1.root / path.lstrip("/")).read_text() == "node1\n"
        assert rig.exec(node2, f"test -e {path}", check=False).returncode == 1
        assert not Path(path).exists()
    finally:
        rig.exec(node1, f"rm -f {path}")


def test_hosts_see_only_the_shared_and_client_parts_of_the_rig_state(rig: Rig) -> None:
    listing = rig.exec("node2", ["ls", str(rig.state_dir)]).stdout.split()
    assert sorted(listing) == ["client", "shared"]
    denied = rig.exec("node2", f"touch {rig.inventory_path}", check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr


def test_sshd_accepts_keys_only(rig: Rig) -> None:
    result = subprocess.run(
        ["ssh", "-F", str(rig.ssh_config_path), "-o", "PubkeyAuthentication=no", "node1", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 255
    assert "Permission denied (publickey)" in result.stderr


def test_the_shared_dir_is_the_same_everywhere(rig: Rig) -> None:
    name = f"shared-{uuid.uuid4().hex}"
    rig.exec(rig.hosts[1], f"echo from-node2 > {rig.shared_dir}/{name}")
    try:
        assert (rig.shared_dir / name).read_text() == "from-node2\n"
        for host in rig.hosts:
            assert rig.ssh(host, f"cat {rig.shared_dir}/{name}").stdout == "from-node2\n"
    finally:
        (rig.shared_dir / name).unlink()


def test_ansible_pings_every_host_through_the_rig_inventory(rig: Rig) -> None:
    result = subprocess.run(
        [
            str(VENV_BIN / "ansible"),
            "-i",
            str(rig.inventory_path),
            "all",
            "-m",
            "ansible.builtin.ping",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for host in rig.hosts:
        assert f"{host.name} | SUCCESS" in result.stdout


def test_torchrun_all_reduce_across_two_hosts(rig: Rig) -> None:
    # Port from the test's own process id: a rerun right after a failure finds the port free.
    port = 29400 + os.getpid() % 1000
    launch = (
        f"GLOO_SOCKET_IFNAME=eth0 {VENV_BIN}/torchrun --nnodes 2 --nproc-per-node 1"
        f" --rdzv-backend c10d --rdzv-endpoint node1:{port} --rdzv-id rig-test {PROBE}"
    )
    ssh = ["ssh", "-F", str(rig.ssh_config_path)]
    launchers = [
        subprocess.Popen(
            [*ssh, h.name, launch], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for h in rig.hosts[:2]
    ]
    outputs = []
    for proc in launchers:
        try:
            out, err = proc.communicate(timeout=100)
        finally:
            proc.kill()
        assert proc.returncode == 0, err[-2000:]
        outputs.append(out)
    assert "rank=0 world=2 host=node1 sum=3" in outputs[0]
    assert "rank=1 world=2 host=node2 sum=3" in outputs[1]


def test_teardown_leaves_nothing_behind(make_rig) -> None:
    private = make_rig(2)
    node1 = private.hosts[0]
    # A stray background process and an extra mount, as a test might leave them.
    stray = int(
        private.exec(node1, "setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $!").stdout
    )
    private.exec(node1, f"mount -t tmpfs tmpfs {private.shared_dir}")
    recorded = [identify(stray), *private.processes()]
    assert all(p is not None and is_running(p) for p in recorded)
    assert private.ssh(node1, "hostname").stdout == "node1\n"

    private.down()

    assert leftovers(private.layout, recorded) == []


def test_sshd_can_be_stopped_and_started_again(make_rig) -> None:
    private = make_rig(1)
    private.stop_sshd("node1")
    down = private.ssh("node1", "true", check=False)
    assert down.returncode == 255 and "Connection refused" in down.stderr
    private.start_sshd("node1")
    assert private.ssh("node1", "hostname").stdout == "node1\n"


def test_a_rig_left_by_a_dead_process_is_torn_down_by_another(rig: Rig) -> None:
    layout = Layout(rig.layout.rig_id, CLI_SLOT)
    started = time.monotonic()
    up = cli("up", "2", "--slot", str(CLI_SLOT))
    print(f"\nCLI `up 2`: {time.monotonic() - started:.2f}s")
    assert up.returncode == 0, up.stderr
    # The CLI process has exited: the rig runs on, recorded in its state file.
    attached = Rig.attach(slot=CLI_SLOT)
    assert attached.ssh("node2", "hostname").stdout == "node2\n"
    status = cli("status")
    assert f"rig {layout.prefix}: 2 hosts" in status.stdout
    recorded = attached.processes()

    # A new `up` of the same instance clears the leftovers before building anew.
    with Rig(1, slot=CLI_SLOT) as again:
        assert all(not is_running(p) for p in recorded)
        assert again.exec("node1", "hostname").stdout == "node1\n"
        recorded += again.processes()
    assert leftovers(layout, recorded) == []

    up = cli("up", "1", "--slot", str(CLI_SLOT))
    assert up.returncode == 0, up.stderr
    down = cli("down", "--slot", str(CLI_SLOT))
    assert down.returncode == 0, down.stderr
    assert leftovers(layout) == []
    # The session rig (slot 0) was not touched.
    assert rig.ssh("node1", "hostname").stdout == "node1\n"


# `python -m tests.rig ARGS` with SIGINT at its default, as a terminal starts it. A process
# inherits an ignored SIGINT (a suite started in the background by a script ignores it), and
# Python then never turns SIGINT into KeyboardInterrupt: `up` ignored the test's Ctrl-C.
UP_AS_FROM_A_TERMINAL = """
import runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.argv[0] = "tests.rig"
runpy.run_module("tests.rig", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_during_up_tears_the_half_built_rig_down(rig: Rig) -> None:
    layout = Layout(rig.layout.rig_id, CLI_SLOT)
    # A killed earlier run's state file would pass the wait below before this `up` wrote its
    # own, and the signal would come before `up` could handle it (seen: -2, or no teardown).
    teardown(layout)
    assert not layout.state_file.exists()
    # 4 hosts: the pause makes the interruption land mid-way whatever the count.
    up = subprocess.Popen(
        [sys.executable, "-c", UP_AS_FROM_A_TERMINAL, "up", "4", "--slot", str(CLI_SLOT)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, PAUSE_ENV: "1", "PYTHONFAULTHANDLER": "1"},
    )
    try:
        # `up` pauses once the hosts' processes exist (and the state file lists them).
        deadline = time.monotonic() + 120
        while not (read_json(layout.state_file) or {}).get("hosts"):
            assert up.poll() is None and time.monotonic() < deadline, up.stderr
            time.sleep(0.05)
        recorded = Rig.attach(slot=CLI_SLOT).processes()
        assert recorded
        up.send_signal(signal.SIGINT)
        try:
            _, err = up.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            # SIGABRT makes faulthandler print where `up` is.
            up.send_signal(signal.SIGABRT)
            _, err = up.communicate(timeout=30)
            raise AssertionError(f"no teardown within 120 s of SIGINT; stderr: {err}") from None
    finally:
        up.kill()
    assert up.returncode == 130, err
    assert err == "error: interrupted; the rig was torn down\n"
    assert leftovers(layout, recorded) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["up", "0"], "host count must be 1.."),
        (["up", str(MAX_HOSTS + 1)], f"host count must be 1..{MAX_HOSTS}"),
        (["up", "three"], "host count must be an integer"),
        (["up"], "the following arguments are required: N"),
    ],
)
def test_bad_host_counts_are_one_line_errors(args: list[str], message: str) -> None:
    result = cli(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert message in result.stderr


def test_a_bad_rig_id_is_a_one_line_error() -> None:
    result = cli("up", "2", env={"RLM_RIG_ID": "12"})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "RLM_RIG_ID must be one digit 0..9" in result.stderr


def test_running_without_root_says_why() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cwd = REPO
        if os.geteuid() == 0:
            # /root (and so the venv's interpreter) is closed to nobody: use the system python;
            # the CLI needs only the standard library up to its root check. The checkout may be
            # closed to nobody too (a clone under `mktemp -d`): run a world-readable copy.
            cwd = Path(tmp) / "checkout"
            shutil.copytree(REPO / "tests" / "rig", cwd / "tests" / "rig")
            shutil.copy(REPO / "tests" / "__init__.py", cwd / "tests")
            shutil.copytree(REPO / "runcontract", cwd / "runcontract")  # stdlib only
            subprocess.run(["chmod", "-R", "a+rX", tmp], check=True)
            argv = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
            argv.append("/usr/bin/python3")
        else:
            argv = [sys.executable]
        result = subprocess.run(
            [*argv, "-m", "tests.rig", "up", "3"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin", "RLM_RIG_ID": os.environ.get("RLM_RIG_ID", "0")},
        )
    assert result.returncode == 2
    assert result.stderr == (
        "error: the rig needs root (network namespaces, mounts, sshd on port 22); run it as root\n"
    )

"""A site behind a login bastion: compute hosts whose sshd answers only the bastion's address.

Ansible reaches them through the ssh configuration (`ansible_ssh_common_args: -F FILE`, a
`ProxyJump` for the compute hosts) and so must rlmctl: `ansible -m ping`, a short playbook,
`rlmctl inventory`, `health`, `launch`, `logs` and `stop` all go through the bastion; the
ProxyCommand form (`-o ProxyCommand="ssh -W %h:%p bastion"`) works too, and a bastion that is
down is one line per host naming it. Fast namespace hosts (no systemd): ~1 s to bring up.

Run as root with this helper's rig id: RLM_RIG_ID=8 .venv/bin/pytest tests/rlmctl/test_bastion.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runcontract.rundir import RunDir
from tests.rlmctl.conftest import REPO, rlmctl, wait_for

pytestmark = pytest.mark.rig

T0 = time.monotonic()


def mark(what: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {what}")


def only_from(rig, host, allowed_ip: str) -> None:
    """The host's sshd refuses (TCP reset) every address but `allowed_ip`, like a compute node
    behind a login node's firewall."""
    rules = (
        "add table inet rlmtest\n"
        "add chain inet rlmtest input { type filter hook input priority 0; policy accept; }\n"
        f"add rule inet rlmtest input tcp dport 22 ip saddr != {allowed_ip} reject with tcp reset\n"
    )
    subprocess.run(
        ["ip", "netns", "exec", host.netns, "nft", "-f", "-"],
        input=rules,
        text=True,
        check=True,
        capture_output=True,
    )


def write_inventory(
    path: Path, rig, compute: dict[str, dict[str, str]], common_args: str, login_args: str
) -> Path:
    """node1 in `login` (reached directly, with `login_args`), node2 and node3 in `compute`
    with `compute`'s host variables and ansible_ssh_common_args `common_args`."""
    lines = [
        "all:",
        "  children:",
        "    login:",
        "      hosts:",
        f"        node1: {json.dumps({'ansible_host': rig.hosts[0].ip, 'ansible_ssh_common_args': login_args})}",
        "    compute:",
        "      hosts:",
    ]
    for name, variables in compute.items():
        lines.append(f"        {name}: {json.dumps(variables)}")
    lines += [
        "      vars:",
        f"        ansible_ssh_common_args: {json.dumps(common_args)}",
        "  vars:",
        "    ansible_user: root",
        f"    ansible_ssh_private_key_file: {rig.ssh_key_path}",
        "    ansible_python_interpreter: /usr/bin/python3",
        f"    rlm_shared_dir: {rig.shared_dir}",
        "    rlm_shared_fs: none",  # the rig's shared directory is the real host's, not Lustre
        "    rlm_gpu_vendor: none",
        "    rlm_gpus_per_node: 1",
        f"    rlm_venv: {sys.prefix}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory):
    """Three hosts: node1 the bastion, node2 and node3 reachable only through it; an inventory
    that reaches them with ProxyJump from an ssh configuration file (`jump`), one with a
    ProxyCommand in ansible_ssh_common_args (`command`)."""
    from tests.conftest import rig_unavailable
    from tests.rig import Rig

    if reason := rig_unavailable():
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("bastion")
    started = time.monotonic()
    rig = Rig(3, slot=1).up()
    try:
        bastion = rig.hosts[0]
        for host in rig.hosts[1:]:
            only_from(rig, host, bastion.ip)
        # The site's ssh configuration: the compute hosts jump through the bastion; addresses,
        # keys and known hosts come from the rig's client configuration (Host nodeK blocks).
        ssh_config = tmp / "ssh_config"
        ssh_config.write_text(
            f"Include {rig.ssh_config_path}\nHost node2 node3\n  ProxyJump node1\n"
        )
        config = f"-F {ssh_config}"
        jump = write_inventory(tmp / "jump.yml", rig, {"node2": {}, "node3": {}}, config, config)
        # Ansible's documented form: a ProxyCommand in ansible_ssh_common_args.
        known = f"-o UserKnownHostsFile={rig.known_hosts_path} -o StrictHostKeyChecking=yes"
        proxy = f'{known} -o ProxyCommand="ssh -F {rig.ssh_config_path} -W %h:%p -q node1"'
        addresses = {h.name: {"ansible_host": h.ip} for h in rig.hosts[1:]}
        command = write_inventory(tmp / "command.yml", rig, addresses, proxy, known)
        mark(f"rig of 3 up, compute hosts firewalled, {time.monotonic() - started:.1f} s")
        yield rig, jump, command
    finally:
        rig.down()


def ansible_env() -> dict[str, str]:
    env = dict(os.environ)
    # A private control socket directory: ControlMaster sockets of other sessions stay apart.
    env["ANSIBLE_SSH_CONTROL_PATH_DIR"] = str(
        Path(env.get("TMPDIR", "/tmp")) / f"rlm-cp-{os.getpid()}"
    )
    return env


def test_direct_ssh_is_refused(site) -> None:
    """Without the bastion the compute hosts cannot be reached: the firewall is real."""
    rig, _, _ = site
    started = time.monotonic()
    result = rlmctl("-i", str(rig.inventory_path), "--limit", "node2", "health", "--json")
    report = json.loads(result.stdout)
    reachable = report["hosts"][0]["checks"][0]
    assert result.returncode == 1 and reachable["state"] == "CRIT", reachable
    assert "refused" in reachable["detail"]
    mark(f"direct health refused in {time.monotonic() - started:.1f} s")


def test_ansible_reaches_the_compute_hosts_through_the_bastion(site, tmp_path: Path) -> None:
    rig, jump, _ = site
    started = time.monotonic()
    ansible = Path(sys.prefix) / "bin"
    ping = subprocess.run(
        [ansible / "ansible", "-i", str(jump), "all", "-m", "ansible.builtin.ping", "-o"],
        capture_output=True, text=True, cwd=REPO, env=ansible_env(), timeout=300, check=False,
    )  # fmt: skip
    assert ping.returncode == 0, ping.stdout + ping.stderr
    assert all(f"{n} | SUCCESS" in ping.stdout for n in ("node1", "node2", "node3")), ping.stdout
    playbook = tmp_path / "short.yml"
    playbook.write_text(
        "- name: A short play through the bastion\n"
        "  hosts: compute\n"
        "  gather_facts: true\n"
        "  tasks:\n"
        "    - name: Write a file\n"
        "      ansible.builtin.copy:\n"
        "        dest: /root/through-the-bastion\n"
        "        content: '{{ ansible_facts.default_ipv4.address | default(ansible_facts.eth0.ipv4.address) }}'\n"
        "        mode: '0644'\n"
    )
    play = subprocess.run(
        [ansible / "ansible-playbook", "-i", str(jump), str(playbook)],
        capture_output=True, text=True, cwd=REPO, env=ansible_env(), timeout=300, check=False,
    )  # fmt: skip
    assert play.returncode == 0, play.stdout[-3000:] + play.stderr[-2000:]
    for host in rig.hosts[1:]:
        assert rig.exec(host, "cat /root/through-the-bastion").stdout == host.ip
    mark(f"ansible ping + playbook through the bastion in {time.monotonic() - started:.1f} s")


def test_rlmctl_health_launch_logs_stop_through_the_bastion(site) -> None:
    rig, jump, _ = site
    started = time.monotonic()
    shown = rlmctl("-i", str(jump), "--limit", "all", "inventory", env={"COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    assert f"root@{rig.hosts[1].ip}:22 via root@{rig.hosts[0].ip}:22 (ProxyJump)" in shown.stdout
    health = rlmctl("-i", str(jump), "health", "--json")
    report = json.loads(health.stdout)
    assert health.returncode == 0, health.stdout + health.stderr
    assert [h["host"] for h in report["hosts"]] == ["node2", "node3"]
    mark(f"health through the bastion: {time.monotonic() - started:.1f} s")

    data = rig.shared_dir / "data"
    subprocess.run(
        [sys.executable, "-m", "trainer", "prepare", "--out", str(data), "--seq-len", "64"],
        check=True, capture_output=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    run = "behind-bastion"
    config = str(REPO / "trainer/configs/tiny.yaml")
    overrides = ["data.path=data", "train.steps=100000", "metrics.log_every=1"]
    launch = rlmctl("-i", str(jump), "launch", "--config", config, "--name", run, *overrides)
    assert launch.returncode == 0, launch.stdout + launch.stderr
    run_dir = RunDir(rig.shared_dir / "runs" / run)
    record = json.loads(run_dir.launch_record_path("node3").read_text())
    assert "--nnodes=2" in record["argv"]
    wait_for(lambda: (run_dir.status().step or 0) >= 3, 240, "step 3 on node2 and node3")
    mark(f"launched and at step 3: {time.monotonic() - started:.1f} s")
    status = rlmctl("-i", str(jump), "status", run, "--json")
    assert status.returncode == 0 and all(h["alive"] for h in json.loads(status.stdout)["hosts"])
    logs = rlmctl("-i", str(jump), "logs", run, "-n", "400")
    assert logs.returncode == 0 and "node2 | " in logs.stdout and "node3 | " in logs.stdout
    assert "step 3/100000" in logs.stdout, logs.stdout[-2000:]
    stop = rlmctl("-i", str(jump), "stop", run, "--timeout", "60", "--json")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert json.loads(stop.stdout)["state"] == "stopped"
    for host in rig.hosts[1:]:
        left = rig.exec(host, f"pgrep -af '[r]un_dir={run_dir.path}' || true").stdout.strip()
        assert left == "", left
    mark(f"health, launch, logs, stop through the bastion: {time.monotonic() - started:.1f} s")


def test_proxycommand_and_a_bastion_that_is_down(site) -> None:
    rig, jump, command = site
    started = time.monotonic()
    health = rlmctl("-i", str(command), "health", "--json")
    assert health.returncode == 0, health.stdout + health.stderr
    checks = [h["checks"][0] for h in json.loads(health.stdout)["hosts"]]
    assert [(c["name"], c["state"]) for c in checks] == [("reachable", "OK")] * 2, checks
    rig.stop_sshd("node1")
    try:
        down = rlmctl("-i", str(jump), "health")
    finally:
        rig.start_sshd("node1")
    assert down.returncode == 1 and "Traceback" not in down.stderr
    # One finding line per host (`node2: reachable CRIT: ...`) below the table's rows.
    lines = [line for line in down.stdout.splitlines() if line.startswith(("node2:", "node3:"))]
    assert len(lines) == 2, down.stdout
    assert all(f"jump host root@{rig.hosts[0].ip}:22 (ProxyJump of node" in line for line in lines)
    assert all("refused the connection" in line for line in lines), lines
    mark(f"ProxyCommand health and bastion down: {time.monotonic() - started:.1f} s")

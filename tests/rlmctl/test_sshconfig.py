"""rlmctl reaches a host the way Ansible's `ssh` does: the inventory's connection variables and
ansible.cfg become ssh's command line, and the ssh configuration files (~/.ssh/config, a `-F`
file, /etc/ssh/ssh_config, Include) fill in HostName, User, Port, keys, known_hosts and
ProxyJump/ProxyCommand, first value wins. `ssh -G` (OpenSSH's own resolution) is the reference
where it is installed. The rig test through a bastion is tests/rlmctl/test_bastion.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from clusterspec import inventory
from rlmctl.errors import RlmctlError
from rlmctl.sshconfig import Resolver, parse_command_line, parse_jump
from tests.rlmctl.conftest import assert_one_line_error, rlmctl

SSH_CONFIG = """\
Host gpu01
  HostName 10.9.9.9
  User bob
  ProxyJump bastion

Host bastion
  HostName 10.9.9.1
  User jump
  Port 2222
  IdentityFile ~/.ssh/bastion_key
  UserKnownHostsFile ~/.ssh/known_bastions

Host gpu02
  HostName 10.9.9.10
  ProxyCommand ssh -W %h:%p -q bastion

Host *
  User nobody-by-default
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home directory of its own with ~/.ssh/config (rlmctl expands ~ with $HOME)."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(SSH_CONFIG)
    monkeypatch.setenv("HOME", str(home))
    return home


def test_ssh_config_supplies_hostname_user_and_proxyjump(home: Path) -> None:
    """The reported case: with ~/.ssh/config read, gpu01 is 10.9.9.9 as bob through bastion
    (it was `gpu01 root None`: Fabric's lazy config read no file)."""
    endpoint = Resolver().resolve("gpu01")
    assert (endpoint.hostname, endpoint.port, endpoint.user) == ("10.9.9.9", 22, "bob")
    jump = endpoint.via
    assert jump is not None and (jump.hostname, jump.port, jump.user) == ("10.9.9.1", 2222, "jump")
    assert jump.identity_files == (str(home / ".ssh/bastion_key"),)
    assert jump.known_hosts_files == (str(home / ".ssh/known_bastions"),)
    assert endpoint.known_hosts_files == (
        str(home / ".ssh/known_hosts"),
        str(home / ".ssh/known_hosts2"),
    )
    assert endpoint.describe() == "bob@10.9.9.9:22 via jump@10.9.9.1:2222 (ProxyJump)"
    proxied = Resolver().resolve("gpu02")
    assert proxied.via is None and proxied.proxy_command == "ssh -W 10.9.9.10:22 -q bastion"


def test_ansible_arguments_come_before_the_files(home: Path) -> None:
    """ansible_user and ansible_port become `-o User=`/`-o Port=` ahead of ~/.ssh/config; a
    ProxyJump in ansible_ssh_common_args is resolved through the files, its own -o options not."""
    args = ("-o", "Port=2201", "-o", "User=root", "-o", "ProxyJump=ops@bastion:22")
    args += ("-o", "UserKnownHostsFile=/cluster/known_hosts", "-o", "StrictHostKeyChecking=no")
    endpoint = Resolver().resolve("gpu01", args)
    assert (endpoint.hostname, endpoint.port, endpoint.user) == ("10.9.9.9", 2201, "root")
    assert endpoint.known_hosts_files == ("/cluster/known_hosts",)
    assert not endpoint.strict
    jump = endpoint.via
    assert jump is not None and (jump.hostname, jump.port, jump.user) == ("10.9.9.1", 22, "ops")
    assert jump.strict and jump.known_hosts_files == (str(home / ".ssh/known_bastions"),)


def test_first_of_proxyjump_and_proxycommand_wins(home: Path) -> None:
    args = ("-o", "ProxyCommand=nc -X connect -x proxy:3128 %h %p")
    endpoint = Resolver().resolve("gpu01", args)  # the file's ProxyJump comes later
    assert (
        endpoint.via is None and endpoint.proxy_command == "nc -X connect -x proxy:3128 10.9.9.9 22"
    )
    assert Resolver().resolve("gpu01", ("-o", "ProxyJump=none")).via is None


def test_f_file_replaces_the_default_files_and_include_is_read(tmp_path: Path, home: Path) -> None:
    (tmp_path / "site.d").mkdir()
    (tmp_path / "site.d" / "compute.conf").write_text(
        "Host node*\n  User trainer\n  ProxyJump login1\nHost login1\n  HostName 192.0.2.1\n"
    )
    config = tmp_path / "site_config"
    config.write_text(f"Include {tmp_path}/site.d/*.conf\nHost *\n  Port 2022\n")
    endpoint = Resolver().resolve("node7", ("-F", str(config)))
    assert (endpoint.hostname, endpoint.port, endpoint.user) == ("node7", 2022, "trainer")
    assert endpoint.via is not None and endpoint.via.hostname == "192.0.2.1"
    # ~/.ssh/config is not read with -F: its catch-all user does not appear
    assert endpoint.via.user is None


def test_jump_chain_and_hop_syntax(home: Path) -> None:
    endpoint = Resolver().resolve(
        "10.0.0.5",
        (
            "-J",
            "a@hop1:2200,[fd00::2]:23",
        ),
    )
    second = endpoint.via
    assert second is not None and (second.hostname, second.port) == ("fd00::2", 23)
    first = second.via
    assert first is not None and (first.user, first.hostname, first.port) == ("a", "hop1", 2200)
    assert parse_jump("ssh://ops@bastion") == ("ops", "bastion", None)
    with pytest.raises(RlmctlError, match="ProxyJump hop"):
        parse_jump("bastion:notaport")


def test_command_line_parsing() -> None:
    parsed = parse_command_line(
        ["-C", "-q", "-oStrictHostKeyChecking=no", "-o", "ProxyJump bastion", "-p2200", "-F", "/c"]
    )
    assert parsed.options == (("StrictHostKeyChecking", "no"), ("ProxyJump", "bastion"))
    assert (parsed.port, parsed.config_file) == (2200, "/c")
    with pytest.raises(RlmctlError, match="Key=Value"):
        parse_command_line(["-o", "=broken"])


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's client for ssh -G")
def test_agrees_with_openssh_itself(home: Path) -> None:
    """`ssh -G` prints what OpenSSH resolves; rlmctl must agree on where it goes. (-F: OpenSSH
    finds ~ through the password database, not $HOME.)"""
    config = ("-F", str(home / ".ssh" / "config"))
    for alias, args in (
        ("gpu01", config),
        ("gpu01", ("-o", "User=root", "-o", "Port=2201", *config)),
        ("bastion", config),
        ("gpu02", config),
        ("gpu02", ("-o", "ProxyJump=j1,j2", *config)),
    ):
        shown = subprocess.run(
            ["ssh", "-G", *args, alias],
            capture_output=True,
            text=True,
            check=True,
            env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
        ).stdout
        openssh = dict(line.split(" ", 1) for line in shown.splitlines() if " " in line)
        ours = Resolver().resolve(alias, args)
        assert (ours.hostname, str(ours.port), ours.user) == (
            openssh["hostname"],
            openssh["port"],
            openssh["user"],
        ), shown
        command = openssh.get("proxycommand")
        if command:
            command = command.replace("%h", openssh["hostname"]).replace("%p", openssh["port"])
        assert ours.proxy_command == command
        hops, hop = [], ours.via
        while hop is not None:
            hops.insert(0, hop.alias)
            hop = hop.via
        assert (",".join(hops) or None) == openssh.get("proxyjump")


def test_inventory_and_ansible_cfg_reach_the_endpoint(tmp_path: Path, home: Path) -> None:
    """`rlmctl inventory --json` shows where SSH goes: ansible.cfg's [ssh_connection]
    ssh_common_args, ansible_ssh_user (an alias Ansible reads), ~/.ssh/config."""
    (tmp_path / "ansible.cfg").write_text(
        "[ssh_connection]\nssh_common_args = -o ProxyJump=bastion\n"
        "[defaults]\nhost_key_checking = False\n"
    )
    hosts = tmp_path / "hosts.yml"
    hosts.write_text(
        "all:\n  hosts:\n    gpu01:\n      ansible_ssh_user: alice\n    gpu03:\n"
        "      ansible_host: 10.9.9.30\n      ansible_port: 2203\n"
    )
    env = {"HOME": str(home), "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg")}
    result = rlmctl("-i", str(hosts), "inventory", "--json", env=env)
    assert result.returncode == 0, result.stderr
    ssh = {h["name"]: h["ssh"] for h in json.loads(result.stdout)["hosts"]}
    assert (ssh["gpu01"]["hostname"], ssh["gpu01"]["user"]) == ("10.9.9.9", "alice")
    assert ssh["gpu01"]["proxy_jump"]["hostname"] == "10.9.9.1"
    assert ssh["gpu01"]["strict_host_key_checking"] == "no"
    assert (ssh["gpu03"]["hostname"], ssh["gpu03"]["port"]) == ("10.9.9.30", 2203)
    assert ssh["gpu03"]["user"] == "nobody-by-default"
    assert ssh["gpu03"]["proxy_jump"]["hostname"] == "10.9.9.1"


def test_bad_ssh_settings_are_one_line(tmp_path: Path, home: Path) -> None:
    hosts = tmp_path / "hosts.yml"
    hosts.write_text(
        "all:\n  hosts:\n    gpu01:\n      ansible_ssh_common_args: -F /nonexistent/ssh_config\n"
    )
    assert_one_line_error(rlmctl("-i", str(hosts), "inventory"), 2, "/nonexistent/ssh_config")


def test_inventory_host_carries_ansibles_ssh_arguments(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yml"
    hosts.write_text(
        "all:\n  hosts:\n    n1:\n      ansible_ssh_host: 10.1.1.1\n      ansible_ssh_port: 2222\n"
        "      ansible_ssh_extra_args: -o ProxyJump=j\n      ansible_host_key_checking: false\n"
    )
    host = inventory.load(hosts).hosts["n1"]
    assert (host.address, host.port) == ("10.1.1.1", 2222)
    args = " ".join(host.ssh_args)
    assert "-o StrictHostKeyChecking=no -o Port=2222" in args and args.endswith("-o ProxyJump=j")


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's client for ssh -G")
def test_include_inside_a_host_block_is_conditional(tmp_path: Path, home: Path) -> None:
    """OpenSSH reads an Include within `Host a` only for a, and its blocks only match then;
    after it, the including block goes on (seen with OpenSSH 9.2: `ssh -G`)."""
    (tmp_path / "inner.conf").write_text("User inner\nHost b*\n  Port 2200\n")
    config = tmp_path / "config"
    config.write_text(
        f"Host compute*\n  Include {tmp_path}/inner.conf\n  HostName 10.1.1.1\n"
        "Host *\n  User outer\n"
    )
    for alias in ("compute1", "bcompute", "b1", "other"):
        shown = subprocess.run(
            ["ssh", "-G", "-F", str(config), alias],
            capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"},
        ).stdout  # fmt: skip
        openssh = dict(line.split(" ", 1) for line in shown.splitlines() if " " in line)
        ours = Resolver().resolve(alias, ("-F", str(config)))
        assert (ours.hostname, str(ours.port), ours.user) == (
            openssh["hostname"],
            openssh["port"],
            openssh["user"],
        ), alias

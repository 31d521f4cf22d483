"""OpenSSH for the rig: keys, sshd and client configuration, known_hosts, readiness."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from tests.rig.errors import RigError

POLL_S = 0.02

# Key-only root login; no PAM (no logind in a chroot). MaxStartups: Ansible (forks=50) and rlmctl fan
# out to one host with many concurrent connections.
SSHD_CONFIG = """\
Port 22
ListenAddress 0.0.0.0
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AuthorizedKeysFile .ssh/authorized_keys
PidFile /run/sshd.pid
MaxStartups 200
MaxSessions 100
AcceptEnv LANG LC_*
Subsystem sftp /usr/lib/openssh/sftp-server
"""

# ~/.ssh/config of root inside every host: host-to-host ssh by name, strictly checked.
NODE_CLIENT_CONFIG = """\
Host *
  StrictHostKeyChecking yes
  UserKnownHostsFile ~/.ssh/known_hosts
  IdentityFile ~/.ssh/id_ed25519
  IdentitiesOnly yes
  BatchMode yes
"""


def generate_keys(keys: Iterable[tuple[Path, str]]) -> None:
    """ed25519 key pairs (`path`, `path`.pub), generated concurrently."""
    procs = []
    for path, comment in keys:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        procs.append(
            subprocess.Popen(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        if proc.returncode != 0:
            raise RigError(f"ssh-keygen failed: {err.decode(errors='replace').strip()}")


def known_hosts_line(name: str, ip: str, host_public_key: str) -> str:
    key_type, key = host_public_key.split()[:2]
    return f"{name},{ip} {key_type} {key}\n"


def client_config(hosts: Iterable[tuple[str, str]], key: Path, known_hosts: Path) -> str:
    """`ssh -F` file for the operator on the real host."""
    blocks = []
    for name, ip in hosts:
        blocks.append(
            f"Host {name} {ip}\n"
            f"  HostName {ip}\n"
            "  User root\n"
            f"  IdentityFile {key}\n"
            "  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {known_hosts}\n"
            "  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n"
            "  BatchMode yes\n"
            "  ConnectTimeout 10\n"
        )
    return "\n".join(blocks)


def wait_sshd(
    addresses: dict[str, str], timeout_s: float, failed: Callable[[str], str | None]
) -> None:
    """Poll until every sshd answers with its banner; `failed(name)` explains a dead sshd."""
    deadline = time.monotonic() + timeout_s
    pending = dict(addresses)
    while pending:
        for name, ip in list(pending.items()):
            if _banner(ip):
                del pending[name]
            elif (why := failed(name)) is not None:
                raise RigError(f"sshd on {name} exited: {why}")
        if pending and time.monotonic() > deadline:
            raise RigError(f"sshd did not answer within {timeout_s:.0f}s on {', '.join(pending)}")
        if pending:
            time.sleep(POLL_S)


def _banner(ip: str) -> bool:
    try:
        with socket.create_connection((ip, 22), timeout=1.0) as conn:
            conn.settimeout(2.0)
            return conn.recv(4).startswith(b"SSH-")
    except OSError:
        return False

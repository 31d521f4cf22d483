"""One host of the rig: its root filesystem, its namespaces and the processes that keep them alive.

Each host has a *holder* process: started inside the host's network namespace, it unshares a mount
and a UTS namespace, sets the hostname, mounts an overlay of the real `/` (private upper dir) plus
/proc, /sys, /dev, /dev/pts, /tmp, /run and the shared directory, then chroots into it and sleeps.
The holder keeps the namespaces alive while sshd is stopped or restarted, and is what `exec`
enters. From the real host, `/proc/<holder pid>/root` is the host's root filesystem.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
from pathlib import Path

from tests.rig.errors import RigError
from tests.rig.layout import Layout

# The project checkout: its venv and code run inside the hosts.
CHECKOUT = Path(__file__).resolve().parents[2]

# Runs as `sh -c SCRIPT holder NAME MERGED UPPER WORK STATE_DIR CHECKOUT`, already inside the new
# namespaces.
_HOLDER_SCRIPT = r"""
set -eu
name=$1 m=$2 upper=$3 work=$4 state=$5 checkout=$6
hostname "$name"
mount -t overlay overlay -o "lowerdir=/,upperdir=$upper,workdir=$work" "$m"
mount -t proc proc "$m/proc"
mount -t sysfs sysfs "$m/sys"
mount --bind /dev "$m/dev"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$m/dev/pts"
mount --bind "$m/dev/pts/ptmx" "$m/dev/ptmx"
mount -t tmpfs -o mode=1777 tmpfs "$m/dev/shm"
mount -t tmpfs -o mode=1777 tmpfs "$m/tmp"
mount -t tmpfs -o mode=0755 tmpfs "$m/run"
mkdir -p "$m/run/sshd"
# A checkout under one of the directories just replaced (CI may clone into /tmp) stays visible at
# its own path, read-only; elsewhere the overlay already shows it.
case "$checkout" in
/tmp/* | /run/* | /dev/shm/*)
    mkdir -p "$m$checkout"
    mount --bind "$checkout" "$m$checkout"
    mount -o remount,bind,ro "$m$checkout"
    ;;
esac
# Hide the rig's state directory (other hosts' upper dirs), then show only the shared directory
# (read-write) and the operator files (read-only) at the paths they have on the real host.
mount -t tmpfs -o mode=0755 tmpfs "$m$state"
mkdir -p "$m$state/shared" "$m$state/client"
mount --bind "$state/shared" "$m$state/shared"
mount --bind "$state/client" "$m$state/client"
mount -o remount,bind,ro "$m$state/client"
# "ready" only once chrooted: `nsenter --root` takes the holder's root, and must never get the
# real one.
exec chroot "$m" /bin/sh -c 'echo ready; exec /bin/sleep infinity'
"""

_EXEC_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "USER": "root",
    "LOGNAME": "root",
    "LANG": "C.UTF-8",
}


def write_root_file(
    upper: Path, path: str, content: str | bytes, mode: int = 0o644, lower_root: Path = Path("/")
) -> None:
    """Write `path` into a host's overlay upper dir before it is mounted.

    Directories created on the way copy mode and owner from the lower root (the real `/` or a
    systemd node's image): an upper directory's attributes replace the lower one's, and sshd
    refuses keys under a loosened /root.
    """
    target = upper / path.lstrip("/")
    missing = []
    parent = target.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        lower = lower_root / directory.relative_to(upper)
        directory.mkdir()
        if lower.is_dir():
            st = lower.stat()
            os.chmod(directory, st.st_mode & 0o7777)
            os.chown(directory, st.st_uid, st.st_gid)
        else:
            os.chmod(directory, 0o700 if directory.name == ".ssh" else 0o755)
    data = content.encode() if isinstance(content, str) else content
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(target, mode)


def start_holder(layout: Layout, name: str, netns: str) -> subprocess.Popen[str]:
    node_dir = layout.node_dir(name)
    for sub in ("merged", "upper", "work"):
        (node_dir / sub).mkdir(parents=True, exist_ok=True)
    # slave propagation: unmounts on the real host (e.g. `ip netns del` of another instance)
    # still reach this mount namespace, while nothing mounted in it leaks out.
    namespaces = ["nsenter", f"--net=/run/netns/{netns}", "--", "unshare", "--mount", "--uts"]
    namespaces += ["--propagation", "slave", "--"]
    script_args = [name, *(str(node_dir / sub) for sub in ("merged", "upper", "work"))]
    script_args += [str(layout.state_dir), str(CHECKOUT)]
    log = open(node_dir / "holder.log", "w")  # noqa: SIM115 - handed to the child
    with log:
        return subprocess.Popen(
            [*namespaces, "sh", "-c", _HOLDER_SCRIPT, "holder", *script_args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,  # survives the CLI that started it and its terminal's Ctrl-C
        )


def wait_holders_ready(
    layout: Layout, holders: dict[str, subprocess.Popen[str]], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    for name, holder in holders.items():
        assert holder.stdout is not None
        ready, _, _ = select.select([holder.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = holder.stdout.readline() if ready else ""
        holder.stdout.close()
        if line.strip() != "ready":
            log = (layout.node_dir(name) / "holder.log").read_text(errors="replace").strip()
            detail = log.splitlines()[-1] if log else "no output before the deadline"
            raise RigError(f"setting up {name}'s namespaces failed: {detail}")


def enter_argv(holder_pid: int, argv: list[str]) -> list[str]:
    """Run `argv` inside the host: its network, mount and UTS namespaces and its chroot."""
    return ["nsenter", "-t", str(holder_pid), "-n", "-m", "-u", "--root", "--wd", "--", *argv]


def exec_env() -> dict[str, str]:
    return dict(_EXEC_ENV)


def start_sshd(layout: Layout, name: str, holder_pid: int) -> subprocess.Popen[bytes]:
    log = open(layout.node_dir(name) / "sshd.log", "ab")  # noqa: SIM115 - handed to the child
    with log:
        return subprocess.Popen(
            enter_argv(holder_pid, ["/usr/sbin/sshd", "-D", "-e"]),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=exec_env(),
            start_new_session=True,
        )


def mount_points(holder_pid: int) -> list[str]:
    """The host's mounts, as the host sees them (mountinfo is relative to the process's root)."""
    try:
        with open(f"/proc/{holder_pid}/mountinfo", encoding="utf-8") as f:
            return [line.split()[4] for line in f]
    except (FileNotFoundError, ProcessLookupError):
        return []

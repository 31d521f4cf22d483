"""Systemd nodes: a Debian image booted with systemd-nspawn inside the node's network namespace.

Each node has a *supervisor* (a small shell, its own session) that puts itself into the node's own
cgroup in every hierarchy, mounts the node's overlay (image root below, private upper dir) in a
mount namespace of its own, and runs `systemd-nspawn --boot` on it. When the node reboots
(`systemctl reboot` inside), nspawn exits with status 133 and the supervisor boots the same overlay
again; SIGTERM to the supervisor halts the node cleanly (nspawn's own SIGTERM handling) and exits.
The supervisor is the PID the rig records and stops; its mount namespace holds the overlay, so
`/proc/<supervisor>/root/<node dir>/merged` is the node's root seen from the real host.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from tests.rig.image import REPO_MOUNT, Image
from tests.rig.layout import Layout
from tests.rig.processes import ProcessId, identify

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNSHARE = ["unshare", "--mount", "--propagation", "slave", "--"]
REBOOT_STATUS = 133  # systemd-nspawn's exit status when the container asked for a reboot

# `sh -c SCRIPT supervisor CGROUP MERGED UPPER WORK LOWER -- NSPAWN_ARGS...`
_SUPERVISOR_SCRIPT = r"""
set -eu
cg=$1 m=$2 upper=$3 work=$4 lower=$5
shift 6
# Its own cgroup in every hierarchy: nspawn nodes started from one shared cgroup collide, and
# the memory hierarchy then measures exactly this node.
for h in /sys/fs/cgroup/*/; do
    [ -w "$h" ] || continue
    mkdir -p "$h$cg" && echo $$ > "$h$cg/cgroup.procs" || true
done
mount -t overlay overlay -o "lowerdir=$lower,upperdir=$upper,workdir=$work" "$m"
# /proc/sys/net of the node's own network namespace writable (per-namespace sysctls); the rest
# of /proc/sys stays read-only: vm.* and kernel.* are the real host's.
export SYSTEMD_NSPAWN_API_VFS_WRITABLE=network
stopping=0 child=
trap 'stopping=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null || true' TERM INT HUP
while :; do
    systemd-nspawn "$@" < /dev/null &
    child=$!
    while :; do
        rc=0
        wait "$child" || rc=$?
        kill -0 "$child" 2>/dev/null || break
    done
    if [ "$stopping" = 1 ] || [ "$rc" != 133 ]; then
        exit "$rc"
    fi
    echo "rig: node rebooting" >&2
done
"""


def cgroup_name(layout: Layout, name: str) -> str:
    return f"{layout.prefix}-{name}"


def start(
    layout: Layout, name: str, netns: str, image: Image, binds: list[tuple[str, bool]]
) -> subprocess.Popen[bytes]:
    """Boot node `name`; `binds` are (path, read_only) shown at the same path inside."""
    node_dir = layout.node_dir(name)
    for sub in ("merged", "upper", "work"):
        (node_dir / sub).mkdir(parents=True, exist_ok=True)
    nspawn = [
        "--quiet",
        "--boot",
        "--register=no",
        "--keep-unit",
        f"--directory={node_dir / 'merged'}",
        f"--machine={name}",
        f"--network-namespace-path=/run/netns/{netns}",
        # nftables in the node; it only reaches the node's own network namespace.
        "--capability=CAP_NET_ADMIN",
        # The kernel log (dmesg, syslog(2)): rlm-exporter's unit is granted CAP_SYSLOG to read
        # GPU errors there, which a node's bounding set must contain for it to be given.
        "--capability=CAP_SYSLOG",
        "--console=read-only",
        "--link-journal=no",
        "--resolv-conf=off",
        "--timezone=off",
        f"--bind-ro={image.repo}:{REPO_MOUNT}",
    ]
    nspawn += [f"--bind{'-ro' if ro else ''}={path}" for path, ro in binds]
    script_args = [cgroup_name(layout, name), *(str(node_dir / s) for s in ("merged", "upper"))]
    script_args += [str(node_dir / "work"), str(image.root), "--"]
    log = open(node_dir / "console.log", "ab")  # noqa: SIM115 - handed to the child
    with log:
        return subprocess.Popen(
            [*UNSHARE, "sh", "-c", _SUPERVISOR_SCRIPT, "supervisor", *script_args, *nspawn],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )


def node_root(layout: Layout, name: str, supervisor_pid: int) -> Path:
    return Path(f"/proc/{supervisor_pid}/root") / str(layout.node_dir(name) / "merged").lstrip("/")


def init_process(netns: str) -> ProcessId | None:
    """The node's PID 1 (systemd): the process of the node's network namespace that is PID 1 of
    its own PID namespace. Found afresh each time: a reboot starts a new one."""
    try:
        inode = f"net:[{os.stat(f'/run/netns/{netns}').st_ino}]"
    except FileNotFoundError:
        return None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/net") != inode:
                continue
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as f:
                nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
        except OSError:
            continue
        if len(nspid) >= 2 and nspid[-1] == "1":
            return identify(int(entry))
    return None


def enter_argv(init_pid: int, argv: list[str]) -> list[str]:
    """Run `argv` inside the booted node: all its namespaces and its root."""
    namespaces = ["-m", "-u", "-i", "-n", "-p", "-C"]
    return ["nsenter", "-t", str(init_pid), *namespaces, "--root", "--wd", "--", *argv]


def memory_bytes(layout: Layout, name: str) -> int | None:
    """Memory charged to the node's cgroup (its processes and the page cache they caused)."""
    usage = CGROUP_ROOT / "memory" / cgroup_name(layout, name) / "memory.usage_in_bytes"
    try:
        return int(usage.read_text())
    except (FileNotFoundError, ValueError):
        return None


def cgroup_processes(layout: Layout) -> tuple[list[ProcessId], list[ProcessId]]:
    """(nspawn processes, all other processes) in this instance's cgroups: what is left of nodes
    whose supervisor was killed, found by the instance's prefix alone."""
    nspawns, others = [], []
    seen = set()
    for procs in CGROUP_ROOT.glob(f"systemd/{layout.prefix}-*/**/cgroup.procs"):
        with contextlib.suppress(OSError):
            for pid in map(int, procs.read_text().split()):
                if pid in seen or (proc := identify(pid)) is None:
                    continue
                seen.add(pid)
                with contextlib.suppress(OSError):
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                    (nspawns if comm == "systemd-nspawn" else others).append(proc)
    return nspawns, others


def remove_cgroups(layout: Layout) -> list[str]:
    """Remove the cgroups named for this instance (deepest first); returns those that remain."""
    left = []
    for hierarchy in sorted(CGROUP_ROOT.glob("*/")):
        for top in sorted(hierarchy.glob(f"{layout.prefix}-*")):
            if not top.is_dir():
                continue
            for directory in sorted(
                (p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
            ):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()
            if top.exists():
                left.append(str(top))
    return left

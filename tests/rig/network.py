"""The rig's network: one Linux bridge per instance, one network namespace per host, joined by a
veth pair whose host-side end is renamed `eth0` (so *_SOCKET_IFNAME=eth0 works on every host)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Callable

from tests.rig.errors import RigError
from tests.rig.layout import Layout
from tests.rig.processes import ProcessId, identify


def _ip(args: list[str], batch: str | None = None, check: bool = True) -> str:
    result = subprocess.run(
        ["ip", *args], input=batch, capture_output=True, text=True, check=False, timeout=120
    )
    if check and result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RigError(f"`ip {' '.join(args)}` failed: {detail}")
    return result.stdout


def create(layout: Layout, count: int) -> None:
    """Bridge with the real host's address, then one namespace + veth per host, in two `ip` runs
    per host at most: with 64 hosts, one process per command would dominate bring-up time."""
    lines = [
        f"link add {layout.bridge} type bridge",
        f"addr add {layout.bridge_ip}/24 dev {layout.bridge}",
        f"link set {layout.bridge} up",
    ]
    for index in range(1, count + 1):
        netns, veth = layout.netns(index), layout.veth(index)
        lines += [
            f"netns add {netns}",
            f"link add {veth} type veth peer name eth0 netns {netns}",
            f"link set {veth} master {layout.bridge} up",
        ]
    _ip(["-batch", "-"], "\n".join(lines) + "\n")
    inside = [
        subprocess.Popen(
            ["ip", "-n", layout.netns(index), "-batch", "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(1, count + 1)
    ]
    errors = []
    for index, proc in enumerate(inside, start=1):
        batch = f"link set lo up\naddr add {layout.host_ip(index)}/24 dev eth0\nlink set eth0 up\n"
        _, err = proc.communicate(batch, timeout=60)
        if proc.returncode != 0:
            errors.append(f"{layout.netns(index)}: {err.strip()}")
    if errors:
        raise RigError(f"configuring host interfaces failed: {errors[0]}")


def list_netns(owns: Callable[[str], bool]) -> list[str]:
    out = _ip(["-j", "netns", "list"], check=False).strip()
    return [entry["name"] for entry in json.loads(out or "[]") if owns(entry["name"])]


def list_links(owns: Callable[[str], bool]) -> list[str]:
    out = _ip(["-j", "link", "show"], check=False).strip()
    return [entry["ifname"] for entry in json.loads(out or "[]") if owns(entry["ifname"])]


def netns_processes(names: list[str]) -> list[ProcessId]:
    """Every process living in one of the named namespaces: what `ip netns pids` finds, in one
    pass over /proc for all namespaces instead of one `ip` run (and /proc scan) per namespace."""
    inodes = set()
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            inodes.add(f"net:[{os.stat(f'/run/netns/{name}').st_ino}]")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            netns = os.readlink(f"/proc/{entry}/ns/net")
        except OSError:  # exited meanwhile, or a kernel thread
            continue
        if netns in inodes and (proc := identify(int(entry))) is not None:
            found.append(proc)
    return found


def delete(owns: Callable[[str], bool]) -> None:
    """Delete the interfaces and namespaces `owns` accepts. Deleting a veth end deletes its pair, so
    nothing waits for the kernel's asynchronous namespace cleanup."""
    lines = [f"link del {name}" for name in list_links(owns)]
    lines += [f"netns del {name}" for name in list_netns(owns)]
    if lines:
        _ip(["-force", "-batch", "-"], "\n".join(lines) + "\n", check=False)
    left = list_links(owns) + list_netns(owns)
    if left:
        raise RigError(f"could not delete {', '.join(left)}; see `ip link` / `ip netns`")

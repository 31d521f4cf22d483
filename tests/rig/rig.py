"""`Rig`: bring up N hosts, run commands in them, tear everything down again."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.rig import inventory, network, node, ssh
from tests.rig.errors import RigError
from tests.rig.layout import MAX_HOSTS, Layout, rig_id_from_env, slot_layouts
from tests.rig.processes import ProcessId, identify, is_running, terminate
from trainer.rundir import read_json, write_json_atomic

BRING_UP_BASE_S = 30.0  # deadline for `up`; generous: 2 loaded cores bring up 64 hosts in ~6 s
BRING_UP_PER_HOST_S = 0.5
STATE_FORMAT = 1


@dataclass(frozen=True)
class Host:
    name: str
    ip: str
    netns: str
    holder: ProcessId

    @property
    def root(self) -> Path:
        """The host's root filesystem, seen from the real host (while the rig is up)."""
        return Path(f"/proc/{self.holder.pid}/root")


class ExecError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        err = (self.stderr or "").strip().splitlines()
        return f"{super().__str__()} {err[-1] if err else ''}".strip()


def require_root() -> None:
    if os.geteuid() != 0:
        raise RigError(
            "the rig needs root (network namespaces, mounts, sshd on port 22); run it as root"
        )


def check_count(count: object) -> int:
    if isinstance(count, bool) or not isinstance(count, int):
        raise RigError(f"host count must be an integer 1..{MAX_HOSTS}, got {count!r}")
    if not 1 <= count <= MAX_HOSTS:
        raise RigError(f"host count must be 1..{MAX_HOSTS}, got {count}")
    return count


class Rig:
    """N hosts node1..nodeN; use as a context manager, or `up()` and `down()`."""

    def __init__(self, count: int, rig_id: int | None = None, slot: int = 0) -> None:
        self.count = check_count(count)
        self.layout = Layout(rig_id_from_env() if rig_id is None else rig_id, slot)
        self.hosts: list[Host] = []
        self._sshd: dict[str, ProcessId] = {}
        self._children: list[subprocess.Popen] = []  # reaped on down(): they are our children
        self.created: float | None = None  # unix time of `up`
        self.bring_up_s: float | None = None  # how long `up` took

    # --- paths -------------------------------------------------------------------------------
    @property
    def state_dir(self) -> Path:
        return self.layout.state_dir

    @property
    def shared_dir(self) -> Path:
        return self.layout.shared_dir

    @property
    def ssh_key_path(self) -> Path:
        return self.layout.client_dir / "id_ed25519"

    @property
    def known_hosts_path(self) -> Path:
        return self.layout.client_dir / "known_hosts"

    @property
    def ssh_config_path(self) -> Path:
        return self.layout.client_dir / "ssh_config"

    @property
    def inventory_path(self) -> Path:
        return self.layout.client_dir / "inventory.yml"

    # --- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> Rig:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> Rig:
        require_root()
        teardown(self.layout)  # leftovers of a killed earlier run of this same instance
        try:
            self._bring_up()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop every process of this instance by PID, delete its namespaces, interfaces and
        state directory. Safe to call repeatedly and on a half-built rig."""
        try:
            teardown(self.layout, extra=self.processes())
        finally:
            for child in self._children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=5)  # only reaps: teardown already killed it
            self._children.clear()
            self.hosts = []
            self._sshd = {}

    def _bring_up(self) -> None:
        layout = self.layout
        started = time.monotonic()
        deadline = started + BRING_UP_BASE_S + BRING_UP_PER_HOST_S * self.count
        self.created = time.time()
        hosts = [(layout.host_name(i), layout.host_ip(i)) for i in range(1, self.count + 1)]
        layout.state_dir.mkdir(mode=0o755, parents=True)
        layout.shared_dir.mkdir(mode=0o1777)
        layout.client_dir.mkdir(mode=0o755)
        # Recorded before anything exists, so that `down` in another process finds this instance
        # even if this one dies half-way.
        self._save_state()

        host_keys = {name: layout.node_dir(name) / "ssh_host_ed25519_key" for name, _ in hosts}
        ssh.generate_keys(
            [(self.ssh_key_path, f"operator@{layout.prefix}")]
            + [(path, f"{name}@{layout.prefix}") for name, path in host_keys.items()]
        )
        network.create(layout, self.count)
        known_hosts = self._write_client_files(hosts, host_keys)
        for name, _ in hosts:
            self._write_root_files(name, hosts, host_keys[name], known_hosts)

        holders = {
            name: node.start_holder(layout, name, layout.netns(i))
            for i, (name, _) in enumerate(hosts, start=1)
        }
        self._children += holders.values()
        for i, ((name, ip), proc) in enumerate(zip(hosts, holders.values(), strict=True), 1):
            holder = identify(proc.pid)
            if holder is None:
                raise RigError(f"the namespace holder of {name} exited at once")
            self.hosts.append(Host(name, ip, layout.netns(i), holder))
        self._save_state()
        node.wait_holders_ready(layout, holders, deadline - time.monotonic())

        for host in self.hosts:
            self._start_sshd(host, record=False)
        self._save_state()
        ssh.wait_sshd(
            {h.name: h.ip for h in self.hosts}, deadline - time.monotonic(), self._sshd_failure
        )
        self.bring_up_s = time.monotonic() - started

    def _write_client_files(self, hosts: list[tuple[str, str]], host_keys: dict[str, Path]) -> str:
        """known_hosts, ssh_config and inventory for the operator; returns known_hosts."""
        known_hosts = "".join(
            ssh.known_hosts_line(name, ip, Path(f"{host_keys[name]}.pub").read_text())
            for name, ip in hosts
        )
        self.known_hosts_path.write_text(known_hosts)
        self.ssh_config_path.write_text(
            ssh.client_config(hosts, self.ssh_key_path, self.known_hosts_path)
        )
        self.inventory_path.write_text(
            inventory.render(
                hosts, self.ssh_key_path, self.known_hosts_path, self.shared_dir, Path(sys.prefix)
            )
        )
        return known_hosts

    def _write_root_files(
        self, name: str, hosts: list[tuple[str, str]], host_key: Path, known_hosts: str
    ) -> None:
        """What differs from the real host's files in one host's root, written before mounting."""
        upper = self.layout.node_dir(name) / "upper"
        etc_hosts = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
        etc_hosts += "".join(f"{ip} {host}\n" for host, ip in hosts)
        client_pub = Path(f"{self.ssh_key_path}.pub").read_text()
        write = node.write_root_file
        write(upper, "/etc/hostname", f"{name}\n")
        write(upper, "/etc/hosts", etc_hosts)
        write(upper, "/etc/ssh/sshd_config", ssh.SSHD_CONFIG)
        write(upper, "/etc/ssh/ssh_host_ed25519_key", host_key.read_bytes(), 0o600)
        write(upper, "/etc/ssh/ssh_host_ed25519_key.pub", Path(f"{host_key}.pub").read_text())
        # Root's own key and known_hosts: host-to-host ssh by name, as on a real cluster.
        write(upper, "/root/.ssh/authorized_keys", client_pub, 0o600)
        write(upper, "/root/.ssh/id_ed25519", self.ssh_key_path.read_bytes(), 0o600)
        write(upper, "/root/.ssh/id_ed25519.pub", client_pub)
        write(upper, "/root/.ssh/known_hosts", known_hosts)
        write(upper, "/root/.ssh/config", ssh.NODE_CLIENT_CONFIG, 0o600)
        # A fresh account's dotfiles, as on a newly installed node: this machine's own ones may
        # initialise pyenv and the like, which costs a second per ssh command and changes PATH.
        for dotfile in (".bashrc", ".profile"):
            skeleton = Path("/etc/skel") / dotfile
            if skeleton.is_file():
                write(upper, f"/root/{dotfile}", skeleton.read_bytes())

    def _save_state(self) -> None:
        write_json_atomic(
            self.layout.state_file,
            {
                "format": STATE_FORMAT,
                "rig_id": self.layout.rig_id,
                "slot": self.layout.slot,
                "count": self.count,
                "created": self.created,
                "owner_pid": os.getpid(),
                "bridge": self.layout.bridge,
                "subnet": self.layout.subnet,
                "hosts": [
                    {
                        "name": h.name,
                        "ip": h.ip,
                        "netns": h.netns,
                        "veth": self.layout.veth(i),
                        "holder": h.holder.to_json(),
                        "sshd": self._sshd[h.name].to_json() if h.name in self._sshd else None,
                        # In the holder's mount namespace only: they go with its last process.
                        "mounts": node.mount_points(h.holder.pid),
                    }
                    for i, h in enumerate(self.hosts, start=1)
                ],
                "inventory": str(self.inventory_path),
                "ssh_config": str(self.ssh_config_path),
                "shared_dir": str(self.shared_dir),
            },
        )

    # --- attaching from another process --------------------------------------------------------
    @classmethod
    def attach(cls, rig_id: int | None = None, slot: int = 0) -> Rig:
        """The running instance recorded in its state.json (e.g. one started by the CLI)."""
        layout = Layout(rig_id_from_env() if rig_id is None else rig_id, slot)
        state = read_json(layout.state_file)
        if not state or not state.get("hosts"):
            raise RigError(
                f"rig {layout.prefix} is not up; start it with `python -m tests.rig up N`"
            )
        rig = cls(int(state["count"]), layout.rig_id, layout.slot)
        rig.created = state.get("created")
        for entry in state["hosts"]:
            holder = ProcessId.from_json(entry["holder"])
            rig.hosts.append(Host(entry["name"], entry["ip"], entry["netns"], holder))
            if entry.get("sshd"):
                rig._sshd[entry["name"]] = ProcessId.from_json(entry["sshd"])
        return rig

    def processes(self) -> list[ProcessId]:
        """The processes the rig itself started (namespace holders and sshd listeners)."""
        return [h.holder for h in self.hosts] + list(self._sshd.values())

    # --- using the hosts ---------------------------------------------------------------------
    def host(self, host: Host | str) -> Host:
        if isinstance(host, Host):
            return host
        for candidate in self.hosts:
            if candidate.name == host:
                return candidate
        raise RigError(
            f"no host {host!r} in rig {self.layout.prefix}; hosts: {[h.name for h in self.hosts]}"
        )

    def exec(
        self,
        host: Host | str,
        cmd: str | Sequence[str],
        check: bool = True,
        timeout: float = 60,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` inside the host as root (a string goes through /bin/sh -c), without SSH."""
        target = self.host(host)
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return _run(
            node.enter_argv(target.holder.pid, argv), check, timeout, input, node.exec_env()
        )

    def ssh(
        self, host: Host | str, cmd: str | Sequence[str], check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` on the host through real SSH from the real host (strict host key checking)."""
        target = self.host(host)
        remote = cmd if isinstance(cmd, str) else shlex.join(cmd)
        argv = ["ssh", "-F", str(self.ssh_config_path), target.name, remote]
        return _run(argv, check, timeout, None, None)

    def stop_sshd(self, host: Host | str) -> None:
        target = self.host(host)
        sshd = self._sshd.pop(target.name, None)
        if sshd is not None and terminate([sshd]):
            raise RigError(f"sshd on {target.name} (pid {sshd.pid}) did not stop")
        self._save_state()
        self._children = [c for c in self._children if c.poll() is None]

    def start_sshd(self, host: Host | str) -> None:
        target = self.host(host)
        if target.name in self._sshd and is_running(self._sshd[target.name]):
            return
        self._start_sshd(target)
        ssh.wait_sshd({target.name: target.ip}, 30.0, self._sshd_failure)

    def _start_sshd(self, host: Host, record: bool = True) -> None:
        proc = node.start_sshd(self.layout, host.name, host.holder.pid)
        self._children.append(proc)
        sshd = identify(proc.pid)
        if sshd is None:
            raise RigError(
                f"sshd on {host.name} exited at once; see {self.layout.node_dir(host.name)}/sshd.log"
            )
        self._sshd[host.name] = sshd
        if record:
            self._save_state()

    def _sshd_failure(self, name: str) -> str | None:
        sshd = self._sshd.get(name)
        if sshd is None or is_running(sshd):
            return None
        log = (self.layout.node_dir(name) / "sshd.log").read_text(errors="replace").strip()
        return log.splitlines()[-1] if log else "no output"


def _run(
    argv: list[str], check: bool, timeout: float, input: str | None, env: dict[str, str] | None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        argv, input=input, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if check and result.returncode != 0:
        raise ExecError(result.returncode, argv, result.stdout, result.stderr)
    return result


def teardown(layout: Layout, extra: Sequence[ProcessId] = ()) -> None:
    """Remove everything of one instance, found by its recorded state AND by its names, so that
    leftovers of a killed run go too. Touches nothing named for another instance."""
    procs = list(extra)
    state = read_json(layout.state_file) or {}
    for entry in state.get("hosts", []):
        procs += [ProcessId.from_json(entry[key]) for key in ("holder", "sshd") if entry.get(key)]
    procs += network.netns_processes(network.list_netns(layout.owns_name))
    left = terminate(procs)
    if left:
        raise RigError(f"processes {[p.pid for p in left]} of rig {layout.prefix} survived SIGKILL")
    network.delete(layout.owns_name)
    _unmount_under(layout.state_dir)
    shutil.rmtree(layout.state_dir, ignore_errors=True)
    if layout.state_dir.exists():
        raise RigError(f"could not remove {layout.state_dir}")


def teardown_all(rig_id: int) -> None:
    """Every slot of one rig id (what `python -m tests.rig down` does)."""
    for layout in slot_layouts(rig_id):
        teardown(layout)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in the real host's mount namespace."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == str(path) or point.startswith(f"{path}/"):
                found.append(point)
    return found


def _unmount_under(path: Path) -> None:
    # The rig mounts nothing here in the real host's namespace; this covers a manual mount left
    # in the state directory, which rmtree would otherwise descend into.
    for point in reversed(mounts_under(path)):
        subprocess.run(["umount", "--lazy", point], check=False, capture_output=True)
    if mounts_under(path):
        raise RigError(f"could not unmount {mounts_under(path)[0]}; unmount it by hand")


def leftovers(layout: Layout, processes: Sequence[ProcessId] = ()) -> list[str]:
    """What of an instance still exists: empty after a complete teardown."""
    found = [f"namespace {name}" for name in network.list_netns(layout.owns_name)]
    found += [f"interface {name}" for name in network.list_links(layout.owns_name)]
    found += [f"mount {point}" for point in mounts_under(layout.state_dir)]
    found += [f"process {proc.pid}" for proc in processes if is_running(proc)]
    if layout.state_dir.exists():
        found.append(f"directory {layout.state_dir}")
    return found

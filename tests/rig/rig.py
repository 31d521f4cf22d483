"""`Rig`: bring up N hosts, run commands in them, tear everything down again."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from runcontract.rundir import read_json, write_json_atomic
from tests.rig import booted, image, inventory, network, node, ssh
from tests.rig.errors import RigError
from tests.rig.layout import MAX_HOSTS, Layout, rig_id_from_env, slot_layouts
from tests.rig.processes import ProcessId, identify, is_running, terminate

BRING_UP_BASE_S = 30.0  # deadline for `up`; generous: 2 loaded cores bring up 64 hosts in ~6 s
BRING_UP_PER_HOST_S = 0.5
# systemd nodes boot a whole init: measured ~2 s each on 2 cores (docs/rig.md); generous deadline.
BOOT_BASE_S = 60.0
BOOT_PER_HOST_S = 10.0
HALT_GRACE_S = 20.0  # a halting node stops its units first
STATE_FORMAT = 2


# Set (to 1), `up` waits for a signal once every host's processes exist (a test interrupts it).
PAUSE_ENV = "RLM_RIG_PAUSE"


@dataclass(frozen=True)
class Host:
    name: str
    ip: str
    netns: str
    holder: ProcessId  # namespace holder, or a systemd node's supervisor
    release: str | None = None  # Debian suite of a systemd node; None: the fast kind (no init)
    boot_dir: str | None = None  # a systemd node's overlay mount point (in its supervisor's view)

    @property
    def root(self) -> Path:
        """The host's root filesystem, seen from the real host (while the rig is up)."""
        base = Path(f"/proc/{self.holder.pid}/root")
        return base / self.boot_dir.lstrip("/") if self.boot_dir else base


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


def check_releases(count: int, release: str | Sequence[str] | None) -> list[str | None]:
    if release is None or isinstance(release, str):
        releases: list[str | None] = [release] * count
    else:
        releases = list(release)
    if len(releases) != count:
        raise RigError(f"{len(releases)} releases given for {count} hosts; give one per host")
    for suite in releases:
        if suite is not None:
            image.check_suite(suite)
    return releases


class Rig:
    """N hosts node1..nodeN; use as a context manager, or `up()` and `down()`.

    `release=None` (default): the fast kind, namespaces over the real `/` with a bare sshd and no
    init. `release="bookworm"` / `"trixie"` (or one per host): systemd nodes booted from a Debian
    image with systemd-nspawn (tests/rig/booted.py)."""

    def __init__(
        self,
        count: int,
        rig_id: int | None = None,
        slot: int = 0,
        release: str | Sequence[str] | None = None,
    ) -> None:
        self.count = check_count(count)
        self.releases = check_releases(self.count, release)
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
        # Images first: built once per (suite, packages), minutes, so not within the deadline.
        images = {suite: image.ensure_image(suite) for suite in set(self.releases) if suite}
        started = time.monotonic()
        deadline = started + BRING_UP_BASE_S + BRING_UP_PER_HOST_S * self.count
        if images:
            deadline += BOOT_BASE_S + BOOT_PER_HOST_S * self.count
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
        for (name, _), suite in zip(hosts, self.releases, strict=True):
            lower = images[suite].root if suite else Path("/")
            self._write_root_files(name, hosts, host_keys[name], known_hosts, lower)

        holders = {}
        binds = [(str(layout.shared_dir), False), (str(layout.client_dir), True)]
        binds += [(str(node.CHECKOUT), True)]  # the code and venv, as on the fast kind
        if not Path(sys.prefix).is_relative_to(node.CHECKOUT):
            binds += [(sys.prefix, True)]
        for i, ((name, ip), suite) in enumerate(zip(hosts, self.releases, strict=True), 1):
            if suite:
                proc = booted.start(layout, name, layout.netns(i), images[suite], binds)
                boot_dir: str | None = str(layout.node_dir(name) / "merged")
            else:
                proc = holders[name] = node.start_holder(layout, name, layout.netns(i))
                boot_dir = None
            self._children.append(proc)
            holder = identify(proc.pid)
            if holder is None:
                raise RigError(f"the namespace holder of {name} exited at once")
            self.hosts.append(Host(name, ip, layout.netns(i), holder, suite, boot_dir))
        self._save_state()
        if os.environ.get(PAUSE_ENV):  # a test interrupts a half-built rig here
            # Slices of sleep, not one blocking call: Python runs the handler between bytecodes,
            # and a SIGINT that came just before a blocking open() began would go unseen.
            while True:
                time.sleep(0.1)
        node.wait_holders_ready(layout, holders, deadline - time.monotonic())

        for host in self.hosts:
            if host.release is None:
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
        self,
        name: str,
        hosts: list[tuple[str, str]],
        host_key: Path,
        known_hosts: str,
        lower: Path,
    ) -> None:
        """What differs from the lower root's files in one host's root, written before mounting.
        A systemd node keeps its image's own sshd_config (what a bare Debian node has)."""
        upper = self.layout.node_dir(name) / "upper"
        etc_hosts = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
        etc_hosts += "".join(f"{ip} {host}\n" for host, ip in hosts)
        client_pub = Path(f"{self.ssh_key_path}.pub").read_text()

        def write(path: str, content: str | bytes, mode: int = 0o644) -> None:
            node.write_root_file(upper, path, content, mode, lower)

        write("/etc/hostname", f"{name}\n")
        write("/etc/hosts", etc_hosts)
        if lower == Path("/"):
            write("/etc/ssh/sshd_config", ssh.SSHD_CONFIG)
        else:
            write("/etc/machine-id", f"{uuid.uuid4().hex}\n", 0o444)
        write("/etc/ssh/ssh_host_ed25519_key", host_key.read_bytes(), 0o600)
        write("/etc/ssh/ssh_host_ed25519_key.pub", Path(f"{host_key}.pub").read_text())
        # Root's own key and known_hosts: host-to-host ssh by name, as on a real cluster.
        write("/root/.ssh/authorized_keys", client_pub, 0o600)
        write("/root/.ssh/id_ed25519", self.ssh_key_path.read_bytes(), 0o600)
        write("/root/.ssh/id_ed25519.pub", client_pub)
        write("/root/.ssh/known_hosts", known_hosts)
        write("/root/.ssh/config", ssh.NODE_CLIENT_CONFIG, 0o600)
        # A fresh account's dotfiles, as on a newly installed node: this machine's own ones may
        # initialise pyenv and the like, which costs a second per ssh command and changes PATH.
        for dotfile in (".bashrc", ".profile"):
            skeleton = Path("/etc/skel") / dotfile
            if skeleton.is_file() and lower == Path("/"):
                write(f"/root/{dotfile}", skeleton.read_bytes())

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
                        "release": h.release,
                        "boot_dir": h.boot_dir,
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
            release, boot_dir = entry.get("release"), entry.get("boot_dir")
            rig.hosts.append(
                Host(entry["name"], entry["ip"], entry["netns"], holder, release, boot_dir)
            )
            if entry.get("sshd"):
                rig._sshd[entry["name"]] = ProcessId.from_json(entry["sshd"])
        rig.releases = [h.release for h in rig.hosts]
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
        if target.release is None:
            entered = node.enter_argv(target.holder.pid, argv)
        else:
            entered = booted.enter_argv(self._init(target).pid, argv)
        return _run(entered, check, timeout, input, node.exec_env())

    def _init(self, host: Host) -> ProcessId:
        init = booted.init_process(host.netns)
        if init is None:
            raise RigError(f"{host.name} is not running (no init in {host.netns})")
        return init

    def reboot(self, host: Host | str, timeout: float = 120) -> None:
        """`systemctl reboot` inside a systemd node; returns once the new boot has finished
        starting its units (`systemctl is-system-running --wait`) and sshd answers."""
        self.reboot_all([host], timeout)

    def reboot_all(self, hosts: Sequence[Host | str], timeout: float = 120) -> None:
        """`reboot` of several systemd nodes at once, as a cluster's nodes reboot: every node is
        told to reboot, then each one's new boot is awaited (`timeout` for them all)."""
        targets = [self.host(h) for h in hosts]
        for target in targets:
            if target.release is None:
                raise RigError(
                    f"{target.name} has no init to reboot; use a systemd node (release=)"
                )
        deadline = time.monotonic() + timeout
        before = {}
        for target in targets:
            before[target.name] = self._init(target)
            self.exec(target, "systemctl reboot", check=False, timeout=timeout)
        for target in targets:
            left = max(1.0, deadline - time.monotonic())
            self.wait_booted(target, left, not_init=before[target.name])

    def wait_booted(
        self, host: Host | str, timeout: float = 120, not_init: ProcessId | None = None
    ) -> str:
        """Wait for a systemd node's boot (one other than `not_init`) to finish starting its units
        and for sshd to answer; returns the system state (`running` or `degraded`)."""
        target = self.host(host)
        deadline = time.monotonic() + timeout
        while (init := booted.init_process(target.netns)) is None or init == not_init:
            if not is_running(target.holder):
                raise RigError(f"{target.name} stopped instead of booting; see its console.log")
            if time.monotonic() > deadline:
                raise RigError(f"{target.name} did not boot again within {timeout:.0f}s")
            time.sleep(ssh.POLL_S * 5)
        left = max(1.0, deadline - time.monotonic())
        state = self.exec(
            target, "systemctl is-system-running --wait", check=False, timeout=left
        ).stdout.strip()
        ssh.wait_sshd({target.name: target.ip}, max(1.0, deadline - time.monotonic()), _alive)
        return state

    def memory_bytes(self, host: Host | str) -> int | None:
        """Memory charged to a systemd node's own cgroup; None for the fast kind."""
        return booted.memory_bytes(self.layout, self.host(host).name)

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
        if target.release is not None:
            self.exec(target, "systemctl stop ssh.service")
            return
        sshd = self._sshd.pop(target.name, None)
        if sshd is not None and terminate([sshd]):
            raise RigError(f"sshd on {target.name} (pid {sshd.pid}) did not stop")
        self._save_state()
        self._children = [c for c in self._children if c.poll() is None]

    def start_sshd(self, host: Host | str) -> None:
        target = self.host(host)
        if target.release is not None:
            self.exec(target, "systemctl start ssh.service")
            ssh.wait_sshd({target.name: target.ip}, 30.0, _alive)
            return
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
        host = self.host(name)
        if host.release is not None:
            if is_running(host.holder):
                return None
            log = (self.layout.node_dir(name) / "console.log").read_text(errors="replace")
            return (log.strip().splitlines() or ["no output"])[-1]
        sshd = self._sshd.get(name)
        if sshd is None or is_running(sshd):
            return None
        log = (self.layout.node_dir(name) / "sshd.log").read_text(errors="replace").strip()
        return log.splitlines()[-1] if log else "no output"


def _alive(name: str) -> None:
    return None


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
    supervisors = []
    for entry in state.get("hosts", []):
        if entry.get("release"):
            supervisors.append(ProcessId.from_json(entry["holder"]))
        procs += [ProcessId.from_json(entry[key]) for key in ("holder", "sshd") if entry.get(key)]
    # systemd nodes first, through their supervisors: nspawn halts the node cleanly, whereas
    # SIGTERM straight to a node's systemd would only make it re-execute itself.
    left = terminate(supervisors, grace_s=HALT_GRACE_S)
    nspawns, others = booted.cgroup_processes(layout)  # of nodes whose supervisor was killed
    left += terminate(nspawns, grace_s=HALT_GRACE_S)
    procs += others + network.netns_processes(network.list_netns(layout.owns_name))
    left += terminate(procs)
    if left:
        raise RigError(f"processes {[p.pid for p in left]} of rig {layout.prefix} survived SIGKILL")
    if cgroups := booted.remove_cgroups(layout):
        raise RigError(f"could not remove cgroup {cgroups[0]} of rig {layout.prefix}")
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
    found += [
        f"cgroup {path}"
        for path in booted.CGROUP_ROOT.glob(f"*/{layout.prefix}-*")
        if path.is_dir()
    ]
    if layout.state_dir.exists():
        found.append(f"directory {layout.state_dir}")
    return found

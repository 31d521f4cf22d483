"""Run a command on many hosts at once: bounded fan-out, per-host timeouts, per-host results.

SSH goes through Fabric (paramiko) with the inventory's user, port and key, and STRICT host key
checking unless the inventory's ansible_ssh_common_args say otherwise. Hosts with
ansible_connection=local run the command in a local shell without SSH. A host that is down only
costs its connect timeout; it never blocks the others, and every host yields one `Result`.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterspec.inventory import Host
from rlmctl.errors import RlmctlError
from rlmctl.sshconfig import Endpoint, Resolver

DEFAULT_FORKS = 128
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 10
TAIL_CHARS = 2000


class JumpError(Exception):
    """The jump host (ProxyJump) in front of a host could not be reached."""

    def __init__(self, jump: Endpoint, error: Exception) -> None:
        super().__init__(str(error))
        self.jump = jump
        self.error = error


class JumpRefused(Exception):
    """The jump host was reached but could not open the connection onwards to the host."""

    def __init__(self, endpoint: Endpoint, error: Exception) -> None:
        super().__init__(str(error))
        self.endpoint = endpoint
        self.error = error


@dataclass
class Result:
    """What one remote action did on one host."""

    host: str
    ok: bool
    rc: int | None
    duration: float
    stdout: str = ""
    stderr: str = ""
    error: str | None = None  # why the action could not run or failed, one line

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "ok": self.ok,
            "rc": self.rc,
            "duration": round(self.duration, 3),
            "stdout": self.stdout[-TAIL_CHARS:],
            "stderr": self.stderr[-TAIL_CHARS:],
            "error": self.error,
        }

    @property
    def reason(self) -> str:
        """The one line to show an operator when the action failed."""
        if self.error:
            return self.error
        lines = [line for line in self.stderr.strip().splitlines() if line.strip()]
        return f"exit {self.rc}: {lines[-1].strip() if lines else 'no output'}"


def python_command(python: str, source: str, *args: str) -> str:
    """A shell command that runs a stdlib-only script on a host without copying a file there.

    The script travels base64-encoded inside the command line, so quoting never breaks it and no
    stdin handling is needed (Fabric keeps stdin open for streams).
    """
    payload = base64.b64encode(source.encode()).decode()
    bootstrap = f"import base64;exec(compile(base64.b64decode('{payload}'),'rlmctl-script','exec'))"
    return " ".join(shlex.quote(word) for word in (python, "-c", bootstrap, *args))


def with_env(command: str, env: dict[str, str] | None) -> str:
    if not env:
        return command
    exports = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(env.items()))
    return f"export {exports}; {command}"


class Fleet:
    """Connections to a set of hosts, reused for every command of one rlmctl invocation."""

    def __init__(
        self,
        hosts: Iterable[Host],
        forks: int = DEFAULT_FORKS,
        timeout: float = DEFAULT_TIMEOUT_S,
        connect_timeout: int = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        self.hosts = list(hosts)
        self.forks = max(1, forks)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        # Per host name and ssh arguments: one host may be reached as two users (rlmctl's Slurm
        # commands log in to the controller as rlm_service_user, everything else as the
        # inventory's user).
        self._connections: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._lock = threading.Lock()
        self._fabric_config: Any = None
        self._resolver = Resolver()
        # Called with every result of every command (a progress display), besides run()'s own.
        self.on_result: Callable[[Result], None] | None = None
        self._endpoints: dict[tuple[str, tuple[str, ...]], Endpoint] = {}
        self._gateways: dict[Endpoint, Any] = {}
        self._gateway_locks: dict[Endpoint, threading.Lock] = {}

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, {}
            gateways, self._gateways = self._gateways, {}
        # Hosts first: their connections are channels of the jump hosts' connections.
        for connection in [*connections.values(), *gateways.values()]:
            with contextlib.suppress(Exception):  # a dead transport has nothing left to close
                connection.close()

    def run(
        self,
        command: str | Callable[[Host], str],
        hosts: Iterable[Host] | None = None,
        timeout: float | None = None,
        on_result: Callable[[Result], None] | None = None,
    ) -> list[Result]:
        """Run `command` (or `command(host)`) on every host; results in host order."""
        targets = list(self.hosts if hosts is None else hosts)
        if not targets:
            return []
        limit = timeout or self.timeout

        def one(host: Host) -> Result:
            text = command(host) if callable(command) else command
            result = self.run_one(host, text, limit)
            if on_result:
                on_result(result)
            if self.on_result:
                self.on_result(result)
            return result

        workers = min(self.forks, len(targets))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rlmctl") as pool:
            return list(pool.map(one, targets))

    def run_one(self, host: Host, command: str, timeout: float) -> Result:
        started = time.monotonic()
        try:
            if host.is_local:
                return _run_local(host, command, timeout, started)
            return self._run_ssh(host, command, timeout, started)
        except Exception as error:  # every host gets a result, whatever went wrong
            return Result(
                host.name,
                False,
                None,
                time.monotonic() - started,
                error=self._describe(host, error),
            )

    def _describe(self, host: Host, error: Exception) -> str:
        if isinstance(error, RlmctlError):  # the ssh configuration itself is wrong
            return str(error)
        if isinstance(error, JumpError):
            return (
                f"jump host {error.jump.describe()} (ProxyJump of {host.name}): "
                + describe_ssh_error(error.jump.alias, error.jump, error.error)
            )
        endpoint = self.endpoint(host)
        if isinstance(error, JumpRefused):
            via = endpoint.via.address if endpoint.via else "the jump host"
            return (
                f"unreachable: {via} cannot connect on to {endpoint.hostname}:{endpoint.port} "
                f"({_first_line(error.error) or 'channel refused'}); is the host up and sshd "
                "running there?"
            )
        return describe_ssh_error(host.name, endpoint, error)

    def endpoint(self, host: Host) -> Endpoint:
        """Where SSH goes for `host`, as `ssh` resolves it for Ansible (rlmctl.sshconfig)."""
        with self._lock:
            endpoint = self._endpoints.get(_key(host))
            if endpoint is None:
                endpoint = self._resolver.resolve(host.address, host.ssh_args)
                self._endpoints[_key(host)] = endpoint
        return endpoint

    def _connection(self, host: Host) -> Any:
        with self._lock:
            connection = self._connections.get(_key(host))
        if connection is not None:
            return connection
        connection = self._open(self.endpoint(host))
        with self._lock:
            self._connections[_key(host)] = connection
        return connection

    def _open(self, endpoint: Endpoint) -> Any:
        """A connected Fabric connection to `endpoint`: directly, through a ProxyCommand, or
        through a `direct-tcpip` channel of its jump host's connection (one connection per jump
        host, shared by every host behind it)."""
        import paramiko
        from fabric import Config

        with self._lock:
            if self._fabric_config is None:
                # One config for all connections; the ssh configuration is read by
                # rlmctl.sshconfig, once, not by Fabric per host.
                self._fabric_config = Config(lazy=True)
        connect_kwargs: dict[str, Any] = {
            "banner_timeout": self.connect_timeout,
            "auth_timeout": self.connect_timeout,
            "allow_agent": not endpoint.identities_only,
        }
        if endpoint.identity_files:
            keys = [k for k in endpoint.identity_files if Path(k).is_file()]
            connect_kwargs.update(key_filename=keys, look_for_keys=False)
        sock = self._socket(endpoint)
        if sock is not None:
            connect_kwargs["sock"] = sock
        connection = _connection_class()(
            endpoint.hostname,
            user=endpoint.login,
            port=endpoint.port,
            config=self._fabric_config,
            connect_timeout=self.connect_timeout,
            connect_kwargs=connect_kwargs,
        )
        client = connection.client
        # Like ssh: every known_hosts file counts (UserKnownHostsFile replaces the default).
        for path in (*endpoint.known_hosts_files, *endpoint.global_known_hosts_files):
            if Path(path).is_file():
                client.load_system_host_keys(path)
        policy = paramiko.RejectPolicy() if endpoint.strict else paramiko.AutoAddPolicy()
        client.set_missing_host_key_policy(policy)
        try:
            connection.open()
        except BaseException:
            with contextlib.suppress(Exception):
                connection.close()
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.close()
            raise
        return connection

    def _socket(self, endpoint: Endpoint) -> Any:
        """What carries the SSH connection when it is not a plain TCP connection."""
        import paramiko

        if endpoint.via is not None:
            gateway = self._gateway(endpoint.via)
            try:
                return gateway.transport.open_channel(
                    "direct-tcpip",
                    dest_addr=(endpoint.hostname, endpoint.port),
                    src_addr=("", 0),
                    timeout=self.connect_timeout,
                )
            except paramiko.SSHException as error:
                raise JumpRefused(endpoint, error) from None
        if endpoint.proxy_command:
            return paramiko.ProxyCommand(endpoint.proxy_command)
        return None

    def _gateway(self, endpoint: Endpoint) -> Any:
        """The open connection to a jump host; made once, remade when it broke."""
        with self._lock:
            lock = self._gateway_locks.setdefault(endpoint, threading.Lock())
        with lock:
            connection = self._gateways.get(endpoint)
            if connection is not None and connection.is_connected:
                return connection
            try:
                connection = self._open(endpoint)
            except JumpError:
                raise
            except Exception as error:
                raise JumpError(endpoint, error) from None
            self._gateways[endpoint] = connection
            return connection

    def _run_ssh(self, host: Host, command: str, timeout: float, started: float) -> Result:
        from invoke.exceptions import CommandTimedOut

        connection = self._connection(host)
        try:
            outcome = connection.run(
                command, hide=True, warn=True, in_stream=False, timeout=timeout, pty=False
            )
        except CommandTimedOut as error:
            return _timed_out(host, started, timeout, error.result.stdout, error.result.stderr)
        except Exception:
            # Forget a broken connection so that the next command on this host reconnects.
            with self._lock:
                self._connections.pop(_key(host), None)
            raise
        return Result(
            host.name,
            outcome.exited == 0,
            outcome.exited,
            time.monotonic() - started,
            outcome.stdout,
            outcome.stderr,
        )


def _key(host: Host) -> tuple[str, tuple[str, ...]]:
    return (host.name, host.ssh_args)


def _timed_out(host: Host, started: float, timeout: float, stdout: str, stderr: str) -> Result:
    """The result of a command that ran past its timeout, over either transport."""
    return Result(
        host.name,
        False,
        None,
        time.monotonic() - started,
        stdout,
        stderr,
        f"timed out after {timeout:g} s; raise --timeout or check the host's load",
    )


def _run_local(host: Host, command: str, timeout: float, started: float) -> Result:
    try:
        completed = subprocess.run(
            ["/bin/sh", "-c", command],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        return _timed_out(host, started, timeout, _text(error.stdout), _text(error.stderr))
    return Result(
        host.name,
        completed.returncode == 0,
        completed.returncode,
        time.monotonic() - started,
        completed.stdout,
        completed.stderr,
    )


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


@functools.cache
def _connection_class() -> Any:
    """Fabric's Connection, safe to make and use from many threads over one Config.

    Connection.__init__ assigns `inline_ssh_env`, which is no attribute of its class, so invoke
    stores it into the shared Config as a modification and re-merges that Config from empty:
    another thread reading it meanwhile got "No attribute or config key found for 'gateway'"
    (seen in bench/fanout.py at 16 hosts). A class attribute makes the assignment an ordinary
    instance attribute."""
    from fabric import Connection

    class SharedConfigConnection(Connection):
        inline_ssh_env = None

    return SharedConfigConnection


def _first_line(error: Exception) -> str:
    message = str(error)
    return message.splitlines()[0] if message else ""


def describe_ssh_error(name: str, endpoint: Endpoint, error: Exception) -> str:
    """One line saying what went wrong connecting to `endpoint` (host `name`) and the fix."""
    import paramiko

    where = f"{endpoint.hostname}:{endpoint.port}"
    route = f" {endpoint.route}" if endpoint.route else ""
    known_hosts = endpoint.known_hosts_files[0] if endpoint.known_hosts_files else "known_hosts"
    scan = f"ssh-keyscan -p {endpoint.port} {endpoint.hostname} >> {known_hosts}"
    if endpoint.via is not None:  # the host answers only the jump host
        scan = f"ssh {endpoint.via.alias} ssh-keyscan -p {endpoint.port} {endpoint.hostname} >> {known_hosts}"
    if isinstance(error, paramiko.BadHostKeyException):
        return (
            f"host key of {where} CHANGED (possible man-in-the-middle or reinstalled host); "
            f"verify, then remove the old key: ssh-keygen -R '[{endpoint.hostname}]:{endpoint.port}' "
            f"-f {known_hosts}"
        )
    message = _first_line(error)
    if isinstance(error, paramiko.SSHException) and "not found in known_hosts" in str(error):
        return f"unknown SSH host key for {name} ({where}{route}); verify and add it: {scan}"
    if isinstance(error, paramiko.AuthenticationException):
        keys = ", ".join(endpoint.identity_files)
        return (
            f"SSH authentication failed as {endpoint.login}@{where}{route}"
            f"{' with key ' + keys if keys else ''}; "
            "fix ansible_user / ansible_ssh_private_key_file (or User / IdentityFile in the ssh "
            "configuration)"
        )
    if isinstance(error, paramiko.ProxyCommandFailure):
        return f"unreachable: ProxyCommand for {where} failed: {message}; fix the ProxyCommand"
    if isinstance(error, (socket.timeout, TimeoutError)):
        return f"unreachable: connecting to {where}{route} timed out; is the host up?"
    if isinstance(error, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionError)):
        return f"unreachable: {where} refused the connection; is sshd running there?"
    if isinstance(error, socket.gaierror):
        return f"unreachable: cannot resolve {endpoint.hostname}; fix ansible_host (or HostName)"
    if isinstance(error, EOFError) or (
        isinstance(error, paramiko.SSHException) and "Error reading SSH protocol banner" in message
    ):
        return f"unreachable: {where}{route} closed the connection before SSH started"
    if isinstance(error, paramiko.SSHException):
        return f"SSH to {where}{route} failed: {message or 'no detail'}"
    if isinstance(error, OSError):
        return f"unreachable: {where}: {error.strerror or message}"
    return f"{type(error).__name__}: {message}"

"""Run a command on many hosts at once: bounded fan-out, per-host timeouts, per-host results.

SSH goes through Fabric (paramiko) with the inventory's user, port and key, and STRICT host key
checking unless the inventory's ansible_ssh_common_args say otherwise. Hosts with
ansible_connection=local run the command in a local shell without SSH. A host that is down only
costs its connect timeout; it never blocks the others, and every host yields one `Result`.
"""

from __future__ import annotations

import base64
import contextlib
import os
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

DEFAULT_FORKS = 128
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 10
TAIL_CHARS = 2000


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
        self._connections: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._fabric_config: Any = None

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, {}
        for connection in connections.values():
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
                host.name, False, None, time.monotonic() - started, error=_describe(host, error)
            )

    def _connection(self, host: Host) -> Any:
        with self._lock:
            connection = self._connections.get(host.name)
            if connection is not None:
                return connection
            if self._fabric_config is None:
                from fabric import Config

                # One config for all connections: loading ssh_config files per host is slow.
                self._fabric_config = Config(lazy=True)
        import paramiko
        from fabric import Connection

        connect_kwargs: dict[str, Any] = {
            "banner_timeout": self.connect_timeout,
            "auth_timeout": self.connect_timeout,
        }
        if host.key_file:
            connect_kwargs.update(key_filename=host.key_file, look_for_keys=False)
        connection = Connection(
            host.address,
            user=host.user,
            port=host.port,
            config=self._fabric_config,
            connect_timeout=self.connect_timeout,
            connect_kwargs=connect_kwargs,
        )
        client = connection.client
        if host.known_hosts_file:
            # Like ssh: UserKnownHostsFile replaces the default file.
            if Path(host.known_hosts_file).is_file():
                client.load_host_keys(host.known_hosts_file)
        else:
            client.load_system_host_keys()
        if host.strict_host_key_checking in ("no", "off", "accept-new"):
            client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        else:
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
        with self._lock:
            self._connections[host.name] = connection
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
                self._connections.pop(host.name, None)
            raise
        return Result(
            host.name,
            outcome.exited == 0,
            outcome.exited,
            time.monotonic() - started,
            outcome.stdout,
            outcome.stderr,
        )


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


def _describe(host: Host, error: Exception) -> str:
    """One line saying what went wrong with a host and how to fix it."""
    import paramiko

    where = f"{host.address}:{host.port}"
    known_hosts = host.known_hosts_file or os.path.expanduser("~/.ssh/known_hosts")
    if isinstance(error, paramiko.BadHostKeyException):
        return (
            f"host key of {where} CHANGED (possible man-in-the-middle or reinstalled host); "
            f"verify, then remove the old key: ssh-keygen -R '[{host.address}]:{host.port}' "
            f"-f {known_hosts}"
        )
    message = str(error)
    if isinstance(error, paramiko.SSHException) and "not found in known_hosts" in message:
        return (
            f"unknown SSH host key for {host.name} ({where}); verify and add it: "
            f"ssh-keyscan -p {host.port} {host.address} >> {known_hosts}"
        )
    if isinstance(error, paramiko.AuthenticationException):
        return (
            f"SSH authentication failed as {host.user or os.environ.get('USER', '?')}@{where}"
            f"{' with key ' + host.key_file if host.key_file else ''}; "
            "fix ansible_user / ansible_ssh_private_key_file"
        )
    if isinstance(error, (socket.timeout, TimeoutError)):
        return f"unreachable: connecting to {where} timed out; is the host up?"
    if isinstance(error, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionError)):
        return f"unreachable: {where} refused the connection; is sshd running there?"
    if isinstance(error, socket.gaierror):
        return f"unreachable: cannot resolve {host.address}; fix ansible_host"
    if isinstance(error, paramiko.SSHException):
        return f"SSH to {where} failed: {message.splitlines()[0] if message else 'no detail'}"
    if isinstance(error, OSError):
        return f"unreachable: {where}: {error.strerror or message}"
    return f"{type(error).__name__}: {message.splitlines()[0] if message else ''}"

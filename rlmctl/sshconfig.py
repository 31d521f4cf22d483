"""Where SSH goes for a host: resolved the way OpenSSH resolves it when Ansible runs `ssh`.

Ansible reaches a host by running `ssh` with arguments built from the inventory and ansible.cfg
(`clusterspec.inventory.Host.ssh_args`: ssh_args, host_key_checking, ansible_port,
ansible_ssh_private_key_file, ansible_user, ansible_ssh_common_args, ansible_ssh_extra_args), and
`ssh` reads its configuration files on top of them: the `-F` file, or else `~/.ssh/config` and
then `/etc/ssh/ssh_config`. For every option the first value obtained wins, so the command line
comes first. paramiko reads no configuration of its own; this module does what `ssh` would:
`Host` and `Match` blocks, `Include`, `HostName`, `User`, `Port`, `IdentityFile`,
`IdentitiesOnly`, `UserKnownHostsFile`, `GlobalKnownHostsFile`, `StrictHostKeyChecking`,
`ProxyCommand` and `ProxyJump` (whichever comes first), each jump host resolved through the same
files and not the command line's `-o` options, as `ssh -J` resolves it.
"""

from __future__ import annotations

import getpass
import glob
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlmctl.errors import RlmctlError

SYSTEM_CONFIG = "/etc/ssh/ssh_config"
DEFAULT_USER_KNOWN_HOSTS = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
DEFAULT_GLOBAL_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
# ssh(1)'s options that take an argument; the others are flags. -o -F -i -J -l -p are read.
WITH_ARGUMENT = set("BbcDEeFIiJLlmOoPpQRSWw")
MAX_JUMPS = 8  # a ProxyJump chain deeper than this is a configuration loop
INCLUDE_RE = re.compile(r"^\s*include\s*[\s=]\s*(.+)$", re.IGNORECASE)


@dataclass(frozen=True)
class Endpoint:
    """One SSH hop as `ssh` would make it: the address it connects to, as whom, with which keys
    and host key files, and how (directly, through the jump host `via`, or a ProxyCommand)."""

    alias: str  # the name given to ssh (ansible_host, or a ProxyJump hop)
    hostname: str
    port: int
    user: str | None  # None: the local user
    identity_files: tuple[str, ...]  # explicitly configured (IdentityFile, -i)
    identities_only: bool
    known_hosts_files: tuple[str, ...]  # UserKnownHostsFile: the first is where keys are added
    global_known_hosts_files: tuple[str, ...]
    strict_host_key_checking: str  # yes and ask (batch) refuse an unknown key; accept-new, no
    via: Endpoint | None = None  # ProxyJump: the hop this one is reached through
    proxy_command: str | None = None

    @property
    def login(self) -> str:
        return self.user or getpass.getuser()

    @property
    def address(self) -> str:
        """`user@hostname:port`, the way an operator writes it."""
        return f"{self.login}@{self.hostname}:{self.port}"

    @property
    def route(self) -> str:
        """How the connection gets there: "" (directly), "via user@bastion:22 (ProxyJump)" or
        "via ProxyCommand `...`"."""
        if self.via is not None:
            hops = []
            hop: Endpoint | None = self.via
            while hop is not None:
                hops.append(hop.address)
                hop = hop.via
            return "via " + " <- ".join(hops) + " (ProxyJump)"
        if self.proxy_command:
            return f"via ProxyCommand `{self.proxy_command}`"
        return ""

    def describe(self) -> str:
        return f"{self.address} {self.route}".strip()

    @property
    def strict(self) -> bool:
        """Refuse a host key that no known_hosts file holds (ssh's `yes`, and `ask` in batch)."""
        return self.strict_host_key_checking not in ("no", "off", "accept-new")

    def as_dict(self) -> dict[str, object]:
        return {
            "hostname": self.hostname,
            "port": self.port,
            "user": self.login,
            "identity_files": list(self.identity_files),
            "known_hosts_files": list(self.known_hosts_files),
            "strict_host_key_checking": self.strict_host_key_checking,
            "proxy_jump": self.via.as_dict() if self.via else None,
            "proxy_command": self.proxy_command,
        }


@dataclass(frozen=True)
class CommandLine:
    """What an ssh argument list says: `-o` options in order (as `Key Value` config lines), the
    `-F` file, and a `-p` port (which wins over every other source)."""

    options: tuple[tuple[str, str], ...]
    config_file: str | None
    port: int | None


def parse_command_line(args: Sequence[str]) -> CommandLine:
    """`-o Key=Value`, `-oKey=Value`, `-o "Key Value"`, `-F file`, `-i key`, `-J jump`, `-l user`,
    `-p port` of an ssh argument list (Ansible's); other flags are skipped with their argument."""
    options: list[tuple[str, str]] = []
    config_file = None
    port = None
    index = 0
    words = list(args)
    while index < len(words):
        word = words[index]
        index += 1
        if not word.startswith("-") or len(word) < 2:
            continue
        flags = word[1:]
        for position, flag in enumerate(flags):
            if flag not in WITH_ARGUMENT:
                continue
            value = flags[position + 1 :]
            if not value:
                if index >= len(words):
                    raise RlmctlError(f"ssh argument -{flag} has no value in {shlex.join(words)!r}")
                value = words[index]
                index += 1
            if flag == "o":
                options.append(option_line(value))
            elif flag == "F":
                config_file = value
            elif flag == "i":
                options.append(("IdentityFile", value))
            elif flag == "J":
                options.append(("ProxyJump", value))
            elif flag == "l":
                options.append(("User", value))
            elif flag == "p":
                port = _port(value, "-p")
            break  # the rest of this word was the argument
    return CommandLine(tuple(options), config_file, port)


def option_line(text: str) -> tuple[str, str]:
    """`Key=Value`, `Key Value` or `Key = Value` as (Key, Value), quotes removed."""
    match = re.match(r"^\s*(\w+)\s*(?:=\s*|\s+)(.*)$", text)
    if not match:
        raise RlmctlError(f"ssh option {text!r} is not Key=Value; fix ansible_ssh_common_args")
    key, value = match.group(1), match.group(2).strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    return key, value


def _port(value: str, what: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise RlmctlError(f"ssh {what} {value!r} is not a port number; fix the inventory")
    return port


def config_text(
    path: str, relative_to: str, condition: tuple[str, ...] = (), depth: int = 0
) -> str:
    """A configuration file as paramiko can read it, its `Include`s inlined with OpenSSH's
    meaning: an included file is read where the directive stands (relative names under ~/.ssh
    for the user's configuration, /etc/ssh for the system's); inside a `Host`/`Match` block
    the inclusion is conditional, so the included blocks also need that block's condition
    (`condition`: `Match` criteria, rewritten into each included `Host`/`Match` line); after
    the file the including block goes on. A missing file is empty."""
    if depth > 16:
        raise RlmctlError(f"ssh configuration {path}: Include nested deeper than 16 (a loop?)")
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    except OSError as error:
        raise RlmctlError(f"cannot read ssh configuration {path}: {error.strerror}") from None
    # The block lines of this file belong to: every host, or the includer's condition.
    header = _block_header(condition)
    lines = [header]
    inner = condition  # the condition of the current block, for nested includes
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        keyword = re.split(r"[\s=]", line.strip(), maxsplit=1)[0].lower() if words else ""
        if keyword == "host":
            patterns = shlex.split(line.strip()[4:].lstrip(" =\t"))
            inner = (*condition, "originalhost " + ",".join(patterns))
            header = _block_header(inner) if condition else line
            lines.append(header)
        elif keyword == "match":
            criteria = line.strip()[5:].lstrip(" =\t")
            if criteria.strip().lower() == "all":
                criteria = ""
            inner = (*condition, criteria) if criteria else condition
            header = _block_header(inner) if condition else line
            lines.append(header)
        elif (include := INCLUDE_RE.match(line)) is not None:
            for pattern in shlex.split(include.group(1)):
                pattern = os.path.expanduser(pattern)
                if not os.path.isabs(pattern):
                    pattern = os.path.join(relative_to, pattern)
                for found in sorted(glob.glob(pattern)):
                    lines.append(config_text(found, relative_to, inner, depth + 1))
            lines.append(header)  # the including block goes on
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _block_header(condition: tuple[str, ...]) -> str:
    return "Match " + " ".join(condition) if condition else "Host *"


class Resolver:
    """Resolves endpoints for one rlmctl command; configuration files are read once."""

    def __init__(self) -> None:
        self._texts: dict[str | None, str] = {}

    def _files_text(self, config_file: str | None) -> str:
        """The configuration `ssh` reads after its command line: the -F file alone ("none": no
        file), or the user's file and then the system's."""
        if config_file not in self._texts:
            if config_file == "none":
                text = ""
            elif config_file is not None:
                path = os.path.expanduser(config_file)
                if not os.path.isfile(path):
                    raise RlmctlError(
                        f"ssh configuration file {config_file} (-F in the inventory's ssh "
                        "arguments) does not exist; fix ansible_ssh_common_args"
                    )
                text = config_text(path, os.path.expanduser("~/.ssh"))
            else:
                user = os.path.expanduser("~/.ssh/config")
                text = config_text(user, os.path.expanduser("~/.ssh"))
                text += config_text(SYSTEM_CONFIG, "/etc/ssh")
            self._texts[config_file] = text
        return self._texts[config_file]

    def resolve(self, alias: str, args: Sequence[str] = ()) -> Endpoint:
        """The endpoint `ssh ARGS ALIAS` connects to."""
        command_line = parse_command_line(args)
        return self._resolve(alias, command_line, None, 0)

    def _resolve(
        self, alias: str, command_line: CommandLine, via: Endpoint | None, depth: int
    ) -> Endpoint:
        from paramiko import SSHConfig
        from paramiko.ssh_exception import ConfigParseError

        if depth > MAX_JUMPS:
            raise RlmctlError(
                f"ssh ProxyJump chain to {alias} is deeper than {MAX_JUMPS} hops; a jump host "
                "jumps through itself? Check ProxyJump in the ssh configuration"
            )
        head = "".join(f"{key} {value}\n" for key, value in command_line.options)
        text = "Host *\n" + head + self._files_text(command_line.config_file)
        try:
            options = SSHConfig.from_text(text).lookup(alias)
        except ConfigParseError as error:
            where = command_line.config_file or "~/.ssh/config or " + SYSTEM_CONFIG
            raise RlmctlError(f"cannot parse the ssh configuration ({where}): {error}") from None
        port = command_line.port or _port(str(options.get("port", 22)), "Port")
        hostname = options.get("hostname", alias)
        files = options.get("userknownhostsfile")
        known = tuple(
            os.path.expanduser(p) for p in (files.split() if files else DEFAULT_USER_KNOWN_HOSTS)
        )
        global_files = options.get("globalknownhostsfile")
        global_known = tuple(global_files.split()) if global_files else DEFAULT_GLOBAL_KNOWN_HOSTS
        identities = tuple(
            os.path.expanduser(p) for p in options.get("identityfile", []) if p.lower() != "none"
        )
        proxy_command, jump = None, None
        # ProxyJump and ProxyCommand exclude each other; the first one obtained wins.
        for key in options:
            if key == "proxycommand":
                proxy_command = options[key]  # None: "ProxyCommand none"
                break
            if key == "proxyjump":
                jump = options[key] if options[key].lower() != "none" else None
                break
        if via is None and jump:
            via = self._jump_chain(jump, alias, command_line.config_file, depth)
        return Endpoint(
            alias=alias,
            hostname=hostname,
            port=port,
            user=options.get("user"),
            identity_files=identities,
            identities_only=options.get("identitiesonly", "no").lower() == "yes",
            known_hosts_files=known,
            global_known_hosts_files=global_known,
            strict_host_key_checking=options.get("stricthostkeychecking", "ask").lower(),
            via=via,
            proxy_command=proxy_command if via is None else None,
        )

    def _jump_chain(
        self, jump: str, alias: str, config_file: str | None, depth: int
    ) -> Endpoint | None:
        """`ssh -J a,b`: a first (through its own ProxyJump, if its configuration has one),
        then b through a; each hop read from the configuration files only, with the user and
        port the hop names."""
        previous: Endpoint | None = None
        for hop in jump.split(","):
            user, host, port = parse_jump(hop.strip())
            if previous is None and host == alias:
                return None  # `Host *` with a ProxyJump matches the jump host itself
            options: list[tuple[str, str]] = []
            if user:
                options.append(("User", user))
            command_line = CommandLine(tuple(options), config_file, port)
            previous = self._resolve(host, command_line, previous, depth + 1)
        return previous


def parse_jump(hop: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` or `ssh://[user@]host[:port]` (IPv6 in brackets)."""
    text = hop.removeprefix("ssh://")
    user, _, rest = text.rpartition("@")
    match = re.match(r"^\[([^\]]+)\](?::(\d+))?$", rest) or re.match(r"^([^:]+)(?::(\d+))?$", rest)
    if not match or not rest:
        raise RlmctlError(f"ProxyJump hop {hop!r} is not [user@]host[:port]; fix it")
    port = _port(match.group(2), "ProxyJump port") if match.group(2) else None
    return user or None, match.group(1), port

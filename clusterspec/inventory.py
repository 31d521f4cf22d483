"""The cluster as the Ansible inventory describes it, loaded through ansible-core's own API.

Read by rlmctl and monitoring/file_sd (ansible-core is imported only when an inventory is loaded).
Whatever `ansible-inventory -i SOURCE` accepts works here (YAML, INI, a directory with
group_vars/ and host_vars/, inventory plugins), and host selection uses Ansible's pattern
language, so `--limit`/`--exclude` mean what they mean to `ansible-playbook`.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterspec import transport
from clusterspec.variables import default, variables

DEFAULT_INVENTORY = "inventory/local"
# Hosts that train; `mgmt` and other groups are for Ansible only.
TRAINING_GROUP = "compute"
# Hosts out for maintenance: left out unless --limit names them.
DRAINED_GROUP = "drained"
GPU_VENDORS = variables()["rlm_gpu_vendor"].choices
SCHEDULERS = variables()["rlm_scheduler"].choices
# The Slurm site options of every job (rlm_slurm_<key>), rendered by rlmctl.slurm.
SLURM_SITE_KEYS = (
    "account",
    "qos",
    "reservation",
    "constraint",
    "sbatch_options",
    "partition_options",
)


class InventoryError(Exception):
    """The inventory cannot be read or selects nothing: one line naming the host, variable or
    pattern and the fix; exit code 2 (an input error)."""

    exit_code = 2


@dataclass(frozen=True)
class Host:
    name: str
    address: str  # what Ansible connects to: ansible_host (an ssh configuration may map it)
    port: int  # ansible_port (22 when unset)
    user: str | None  # ansible_user
    connection: str  # "ssh" or "local"
    # The arguments Ansible's ssh connection gives `ssh` for this host (ansible.cfg's ssh_args,
    # host_key_checking, ansible_port, ansible_ssh_private_key_file, ansible_user,
    # ansible_ssh_common_args, ansible_ssh_extra_args): rlmctl.sshconfig resolves them with the
    # ssh configuration files as `ssh` does.
    ssh_args: tuple[str, ...]
    groups: tuple[str, ...]
    gpus_per_node: int
    gpu_vendor: str  # "nvidia", "amd", "none" or "auto" (detected on the host)
    shared_dir: str
    venv: str | None
    rdzv_port: int
    comm_env: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    interpreter: str = "python3"  # ansible_python_interpreter: runs rlmctl's stdlib-only scripts
    busbw_floor_gbps: float | None = None  # rlm_comm_busbw_floor_gbps; 0 = report, don't gate
    exporter_port: int = default("rlm_exporter_port")
    gpu_link: str | None = None  # rlm_gpu_link: expected GPU-to-GPU link; None = the SKU's
    fabric: str | None = None  # rlm_fabric: ib, roce, socket; None = transport not judged
    gpudirect: bool | None = None  # rlm_gpudirect
    prometheus_url: str | None = None  # rlm_prometheus_url
    monitoring_ca_file: str | None = None  # rlm_monitoring_tls_ca (a controller path)
    monitoring_username: str = ""  # rlm_monitoring_username
    monitoring_password: str = field(default="", repr=False, compare=False)
    accept_thresholds: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    scheduler: str = default("rlm_scheduler")  # "ssh" or "slurm": what starts the trainer
    gpu_memory_gib: float | None = None  # rlm_gpu_memory_gib: launch checks the memory estimate
    # The shared directory's owner, filesystem and free-space floor (clusterspec/shared_dir.py);
    # the owner is also who Slurm jobs run as (never root).
    service_user: str = default("rlm_service_user")
    shared_fs: str = default("rlm_shared_fs")
    shared_min_free_gib: float = default("rlm_shared_min_free_gib")
    # rlm_slurm_account, _qos, _reservation, _constraint, _sbatch_options, _partition_options as
    # the inventory has them (keys without the rlm_slurm_ prefix); rlmctl.slurm checks them.
    slurm_site: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    container_image: str | None = None  # rlm_container_image: the trainer runs in this image
    # rlm_container_options: more `podman run` options (SSH) or pyxis srun options (Slurm)
    container_options: tuple[str, ...] = ()

    @property
    def is_local(self) -> bool:
        return self.connection == "local"

    @property
    def python(self) -> str:
        """The interpreter of the training environment on the host."""
        if self.venv:
            return f"{self.venv.rstrip('/')}/bin/python"
        return sys.executable if self.is_local else "python3"

    @property
    def script_python(self) -> str:
        """The interpreter for rlmctl's stdlib-only host scripts (health checks, processes)."""
        return sys.executable if self.is_local else self.interpreter

    @property
    def runs_dir(self) -> Path:
        return Path(self.shared_dir) / "runs"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "address": self.address,
            "port": self.port,
            "user": self.user,
            "connection": self.connection,
            "groups": list(self.groups),
            "gpus_per_node": self.gpus_per_node,
            "gpu_vendor": self.gpu_vendor,
            "shared_dir": self.shared_dir,
            "venv": self.venv,
            "rdzv_port": self.rdzv_port,
            "comm_env": self.comm_env,
            "fabric": self.fabric,
            "gpudirect": self.gpudirect,
        }


# The options of Ansible's ssh connection plugin that shape the `ssh` command line.
SSH_PLUGIN_OPTIONS = (
    "host",
    "remote_user",
    "port",
    "ssh_args",
    "ssh_common_args",
    "ssh_extra_args",
    "private_key_file",
    "host_key_checking",
)


class SshSettings:
    """Ansible's ssh connection options outside the inventory (ansible.cfg, ANSIBLE_* environment,
    defaults), read once, and the host variables that override each (`ansible_user`,
    `ansible_ssh_user`, ...), in Ansible's order: the last variable listed that a host sets wins.
    """

    def __init__(self) -> None:
        from ansible import constants
        from ansible.plugins.loader import connection_loader

        connection_loader.get("ssh", class_only=True)  # registers the plugin's options
        definitions = constants.config.get_configuration_definitions("connection", "ssh")
        self.base = constants.config.get_plugin_options("connection", "ssh", variables={})
        self.variables = {
            name: [entry["name"] for entry in definitions[name].get("vars", [])]
            for name in SSH_PLUGIN_OPTIONS
        }

    def options(self, var: Any, hostvars: dict[str, Any]) -> dict[str, Any]:
        """The plugin's options for one host (`var(name)`: the host's templated variable)."""
        values = {name: self.base.get(name) for name in SSH_PLUGIN_OPTIONS}
        for name, names in self.variables.items():
            for variable in names:
                if variable in hostvars:
                    values[name] = var(variable)
        return values


def ssh_command_args(options: dict[str, Any], key_file: str | None) -> tuple[str, ...]:
    """The options part of the `ssh` command Ansible builds (its ssh plugin's _build_command, less
    its own ControlPath and authentication-method options): for every option, the first value
    `ssh` sees wins."""
    from ansible.module_utils.parsing.convert_bool import boolean

    args = shlex.split(str(options["ssh_args"] or ""))
    if options["host_key_checking"] is not None and not boolean(options["host_key_checking"]):
        args += ["-o", "StrictHostKeyChecking=no"]
    if options["port"] is not None:
        args += ["-o", f"Port={options['port']}"]
    if key_file:
        args += ["-o", f"IdentityFile={key_file}"]
    if options["remote_user"]:
        args += ["-o", f"User={options['remote_user']}"]
    for name in ("ssh_common_args", "ssh_extra_args"):
        args += shlex.split(str(options[name] or ""))
    return tuple(args)


class Inventory:
    """A loaded inventory: every host with its resolved connection and bundle variables."""

    def __init__(self, source: Path, manager: Any, hosts: dict[str, Host]) -> None:
        self.source = source
        self._manager = manager
        self.hosts = hosts

    @property
    def groups(self) -> dict[str, list[str]]:
        return {
            name: sorted(h.name for h in group.get_hosts())
            for name, group in sorted(self._manager.groups.items())
            if name != "all" and (name != "ungrouped" or group.get_hosts())
        }

    def _match(self, pattern: str, option: str) -> list[str]:
        from ansible.errors import AnsibleError

        try:
            with _quiet():
                return [h.name for h in self._manager.get_hosts(pattern)]
        except AnsibleError as error:
            message = str(error).splitlines()[0].replace(", ignoring", "")
            raise InventoryError(
                f"{option} {pattern!r}: {message} in {self.source}; "
                f"see the hosts with `rlmctl -i {self.source} inventory`"
            ) from None

    def select(self, limit: str | None = None, exclude: str | None = None) -> list[Host]:
        """The hosts to act on, in inventory order.

        Without --limit: the `compute` group when the inventory has one, else all hosts; hosts
        in the `drained` group are left out.
        """
        default = TRAINING_GROUP if TRAINING_GROUP in self._manager.groups else "all"
        if (
            DRAINED_GROUP in self._manager.groups
            and self._manager.groups[DRAINED_GROUP].get_hosts()
        ):
            default += f":!{DRAINED_GROUP}"
        names = self._match(limit or default, "--limit")
        if exclude:
            excluded = set(self._match(exclude, "--exclude"))
            names = [n for n in names if n not in excluded]
        if not names:
            raise InventoryError(
                f"no hosts selected from {self.source} (limit={limit or default!r}, "
                f"exclude={exclude!r}); widen --limit or drop --exclude"
            )
        return [self.hosts[n] for n in names]


@contextlib.contextmanager
def _quiet() -> Any:
    """Ansible prints warnings while it parses; we turn failures into one-line errors instead
    (the captured warnings, yielded, say why a source failed to parse)."""
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(io.StringIO()):
        yield captured


PARSE_FAILURE = re.compile(r"Failed to parse inventory with '(\w+)' plugin: (.+)")
ORIGIN = re.compile(r"^Origin: (.+):(\d+):(\d+)$", re.MULTILINE)


def _parse_failure(warnings: str, source: Path) -> str | None:
    """Why Ansible could not parse `source`, from its warnings: the reason of the plugin that
    reads files of its kind (yaml for .yml/.yaml, ini otherwise), with the line and column."""
    if source.is_dir():
        wanted: tuple[str, ...] = ("yaml", "auto", "ini")
    else:
        wanted = ("yaml", "auto") if source.suffix in (".yml", ".yaml") else ("ini",)
    for block in re.split(r"\[WARNING\]: ", warnings):
        match = PARSE_FAILURE.search(block)
        if match is None or match.group(1) not in wanted:
            continue
        reason = match.group(2).strip().rstrip(".")
        origin = ORIGIN.search(block)
        where = f" (line {origin.group(2)}, column {origin.group(3)})" if origin else ""
        if "duplicate mapping key" in reason:
            reason += f"{where}: a host, group or variable is given twice; keep one"
            where = ""
        return reason + where
    return None


def _first_reason(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = [line for line in lines if "caused by" not in line and "<<<" not in line]
    return "; ".join(detail[-2:]) if detail else type(error).__name__


def load(source: str | Path) -> Inventory:
    """Parse an inventory source; a path that is missing or does not parse is an InventoryError."""
    source = Path(source)
    if not source.exists():
        raise InventoryError(
            f"inventory {source} does not exist; pass -i PATH or set RLM_INVENTORY "
            f"(default {DEFAULT_INVENTORY})"
        )
    # Set before ansible is imported: its constants are read once at import time.
    os.environ.setdefault("ANSIBLE_HOST_PATTERN_MISMATCH", "error")
    os.environ.setdefault("ANSIBLE_INVENTORY_UNPARSED_FAILED", "true")
    os.environ.setdefault("ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED", "true")
    os.environ.setdefault("ANSIBLE_LOCALHOST_WARNING", "false")
    # A key given twice in one YAML mapping (a host defined twice) keeps only the last: refuse.
    os.environ.setdefault("ANSIBLE_DUPLICATE_YAML_DICT_KEY", "error")
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    warnings = io.StringIO()
    try:
        with _quiet() as warnings:
            manager = InventoryManager(loader=loader, sources=[str(source)])
            variables = VariableManager(loader=loader, inventory=manager)
            ssh = SshSettings()
            hosts = {
                h.name: _host(h, variables, loader, source, ssh) for h in manager.get_hosts("all")
            }
    except AnsibleError as error:
        reason = _parse_failure(warnings.getvalue(), source) or _first_reason(error)
        raise InventoryError(
            f"cannot load inventory {source}: {reason}; "
            f"check it with `ansible-inventory -i {source} --graph`"
        ) from None
    if not hosts:
        raise InventoryError(f"inventory {source} has no hosts; add hosts or pass another -i")
    _refuse_duplicates(hosts, source)
    return Inventory(source, manager, hosts)


def _refuse_duplicates(hosts: dict[str, Host], source: Path) -> None:
    """Two names for one SSH endpoint would start two trainers on one machine."""
    seen: dict[tuple[str, int], str] = {}
    for host in hosts.values():
        if host.is_local:
            continue
        key = (host.address, host.port)
        if key in seen:
            raise InventoryError(
                f"hosts {seen[key]} and {host.name} are both {host.address}:{host.port}; "
                f"list each machine once in {source} (or give them distinct ansible_host)"
            )
        seen[key] = host.name


def _host(host: Any, variables: Any, loader: Any, source: Path, ssh: SshSettings) -> Host:
    from ansible.errors import AnsibleError
    from ansible.template import Templar

    hostvars = variables.get_vars(host=host, include_hostvars=False)
    templar = Templar(loader=loader, variables=hostvars)

    def var(name: str, fallback: Any = None) -> Any:
        """The host's value; an rlm_* variable falls back to its clusterspec default only."""
        if name not in hostvars:
            return default(name) if name.startswith("rlm_") else fallback
        try:
            return templar.template(hostvars[name])
        except AnsibleError as error:
            raise InventoryError(
                f"host {host.name}: variable {name} does not resolve ({_first_reason(error)}); "
                f"fix it in {source}"
            ) from None

    def integer(name: str, fallback: int | None = None) -> int:
        value = var(name, fallback)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise InventoryError(
                f"host {host.name}: {name} must be an integer, got {value!r}; fix it in {source}"
            ) from None

    inventory_dir = Path(str(hostvars.get("inventory_dir") or source.parent))
    options = ssh.options(var, hostvars)
    key_file = options["private_key_file"]
    port = options["port"]
    shared_dir = str(var("rlm_shared_dir"))
    comm_env = var("rlm_comm_env") or {}
    if not isinstance(comm_env, dict):
        raise InventoryError(
            f"host {host.name}: rlm_comm_env must be a mapping like {{NCCL_SOCKET_IFNAME: ib0}}, "
            f"got {comm_env!r}; fix it in {source}"
        )
    # Kept only when literal: "{{ ansible_playbook_python }}" means nothing outside a playbook.
    raw_interpreter = str(hostvars.get("ansible_python_interpreter") or "python3")
    interpreter = "python3" if "{{" in raw_interpreter else raw_interpreter
    vendor = str(var("rlm_gpu_vendor")).lower()
    if vendor not in GPU_VENDORS:
        raise InventoryError(
            f"host {host.name}: rlm_gpu_vendor must be one of {', '.join(GPU_VENDORS)}, "
            f"got {vendor!r}; fix it in {source}"
        )
    scheduler = str(var("rlm_scheduler")).lower()
    if scheduler not in SCHEDULERS:
        raise InventoryError(
            f"host {host.name}: rlm_scheduler must be one of {', '.join(SCHEDULERS)}, "
            f"got {scheduler!r}; fix it in {source}"
        )
    floor = var("rlm_comm_busbw_floor_gbps")
    fabric = var("rlm_fabric")
    if fabric is not None and str(fabric) not in transport.FABRICS:
        raise InventoryError(
            f"host {host.name}: rlm_fabric must be one of {', '.join(transport.FABRICS)} or null, "
            f"got {fabric!r}; fix it in {source}"
        )
    gpudirect = var("rlm_gpudirect")
    gpu_memory = var("rlm_gpu_memory_gib")
    try:
        gpu_memory_gib = None if gpu_memory is None else float(gpu_memory)
    except (TypeError, ValueError):
        gpu_memory_gib = -1.0
    if gpu_memory_gib is not None and not 0 < gpu_memory_gib < float("inf"):
        raise InventoryError(
            f"host {host.name}: rlm_gpu_memory_gib must be the GiB of one GPU, e.g. 80, got "
            f"{gpu_memory!r}; fix it in {source}"
        )
    ca_file = var("rlm_monitoring_tls_ca")
    # RoCE/IB knobs become NCCL variables; an explicit rlm_comm_env entry wins.
    fabric_env = transport.fabric_env({name: var(name) for name in transport.FABRIC_ENV})
    comm_env = {**fabric_env, **comm_env}
    connection = str(var("ansible_connection", "ssh")).split(".")[-1]
    # The one exception the spec documents: a local host without rlm_venv uses this interpreter.
    venv = None if connection == "local" and "rlm_venv" not in hostvars else var("rlm_venv")
    venv = _expand(str(venv), inventory_dir) if venv else None
    try:
        port = 22 if port is None else int(port)
    except (TypeError, ValueError):
        raise InventoryError(
            f"host {host.name}: ansible_port must be an integer, got {port!r}; fix it in {source}"
        ) from None
    key_file = _expand(str(key_file), inventory_dir) if key_file else None
    return Host(
        name=host.name,
        address=str(options["host"] or host.name),
        port=port,
        user=str(options["remote_user"]) if options["remote_user"] else None,
        connection=connection,
        ssh_args=ssh_command_args(options, key_file),
        groups=tuple(sorted(g.name for g in host.get_groups() if g.name != "all")),
        gpus_per_node=integer("rlm_gpus_per_node"),
        gpu_vendor=vendor,
        shared_dir=_expand(shared_dir, inventory_dir),
        venv=venv,
        rdzv_port=integer("rlm_rdzv_port"),
        comm_env={str(k): str(v) for k, v in comm_env.items()},
        interpreter=interpreter,
        busbw_floor_gbps=float(floor) if floor is not None else None,
        exporter_port=integer("rlm_exporter_port"),
        gpu_link=str(var("rlm_gpu_link")) if var("rlm_gpu_link") else None,
        fabric=str(fabric) if fabric is not None else None,
        prometheus_url=str(var("rlm_prometheus_url")) if var("rlm_prometheus_url") else None,
        monitoring_ca_file=_expand(str(ca_file), inventory_dir) if ca_file else None,
        monitoring_username=str(var("rlm_monitoring_username") or ""),
        monitoring_password=str(var("rlm_monitoring_password") or ""),
        accept_thresholds=var("rlm_accept_thresholds"),
        gpudirect=None if gpudirect is None else str(gpudirect).lower() in ("true", "yes", "1"),
        scheduler=scheduler,
        gpu_memory_gib=gpu_memory_gib,
        service_user=str(var("rlm_service_user")),
        slurm_site={key: var(f"rlm_slurm_{key}") for key in SLURM_SITE_KEYS},
        container_image=str(var("rlm_container_image")) if var("rlm_container_image") else None,
        container_options=_string_list(host.name, "rlm_container_options", var, source),
        shared_fs=str(var("rlm_shared_fs")),
        shared_min_free_gib=float(var("rlm_shared_min_free_gib")),
    )


def _string_list(host: str, name: str, var: Any, source: Path) -> tuple[str, ...]:
    value = var(name) or []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InventoryError(
            f'host {host}: {name} must be a list of strings like ["--device=/dev/kfd"], '
            f"got {value!r}; fix it in {source}"
        )
    return tuple(value)


def _expand(path: str, base: Path) -> str:
    """`~` expanded; a relative path is relative to the inventory's directory, like Ansible's."""
    expanded = Path(os.path.expanduser(path))
    if not expanded.is_absolute():
        expanded = base / expanded
    return os.path.normpath(expanded)

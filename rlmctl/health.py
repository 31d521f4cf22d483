"""The pre-launch gate: fast checks on every host in ONE round trip each, judged on the controller.

Each host runs `rlmctl/hostcheck.py` (shipped inside the command line) which checks disk, the
shared filesystem, memory, load, GPUs, XIDs, the GPU topology (links and NIC affinity), the
rendezvous port and the Python environment in parallel. The controller adds what only a fleet-wide view can judge: reachability, clock skew
against the controller, and that every host runs the same environment. States follow Nagios;
the worst one wins with OK < UNKNOWN < WARN < CRIT (monitoring-plugins' max_state_alt).
"""

from __future__ import annotations

import functools
import importlib
import json
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterspec.inventory import Host
from rlmctl.errors import RlmctlError
from rlmctl.remote import Fleet, Result, python_command

OK, WARN, CRIT, UNKNOWN = "OK", "WARN", "CRIT", "UNKNOWN"
SEVERITY = {OK: 0, UNKNOWN: 1, WARN: 2, CRIT: 3}

# This project's choices; the shared directory's (disk use, free-space floor) are
# clusterspec/shared_dir.py's, which playbooks/verify.yml applies too.
THRESHOLDS: dict[str, float] = {
    "mem_warn_pct": 10,
    "mem_crit_pct": 5,
    "load_warn_per_cpu": 4.0,
    "gpu_temp_warn_c": 85,
    "gpu_temp_crit_c": 95,
    "clock_warn_s": 1.0,  # log correlation gets confusing
    "clock_crit_s": 30.0,  # TLS, Kerberos and checkpoint ages go wrong
    "env_timeout_s": 30,
}
MARKER_DIR = ".rlmctl"


@dataclass
class Check:
    name: str
    state: str
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "state": self.state, "detail": self.detail, "fix": self.fix}


@dataclass
class HostHealth:
    host: str
    checks: list[Check] = field(default_factory=list)
    duration: float = 0.0
    env: dict[str, str] | None = None

    @property
    def state(self) -> str:
        return worst(c.state for c in self.checks)

    @property
    def critical(self) -> list[Check]:
        return [c for c in self.checks if c.state == CRIT]

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "state": self.state,
            "duration": round(self.duration, 3),
            "checks": [c.as_dict() for c in self.checks],
            "env": self.env,
        }


def worst(states: Any) -> str:
    return max(states, key=lambda s: SEVERITY[s], default=OK)


@dataclass
class Report:
    hosts: list[HostHealth]

    @property
    def state(self) -> str:
        return worst(h.state for h in self.hosts)

    @property
    def healthy(self) -> list[str]:
        return [h.host for h in self.hosts if h.state != CRIT]

    @property
    def failed(self) -> list[HostHealth]:
        return [h for h in self.hosts if h.state == CRIT]

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "hosts": [h.as_dict() for h in self.hosts]}


# Shipped with hostcheck.py: the vendor descriptions and the shared directory's checks it imports
# (stdlib only).
SHIPPED_PACKAGES = ("clusterspec", "clusterspec.vendors")
SHIPPED_MODULES = ("clusterspec.shared_dir",)
_IMPORTER = """
import importlib.abc, importlib.util, sys

class _Shipped(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # Modules that travel inside this command line: name -> (source, is_package).
    def __init__(self, sources):
        self.sources = sources
    def find_spec(self, name, path=None, target=None):
        if name not in self.sources:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=self.sources[name][1])
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        source = self.sources[module.__spec__.name][0]
        exec(compile(source, "<shipped " + module.__spec__.name + ">", "exec"), module.__dict__)

sys.meta_path.insert(0, _Shipped(SHIPPED))
"""


@functools.cache
def _script() -> str:
    """hostcheck.py, preceded by an importer of the shipped vendor-description modules."""
    sources: dict[str, tuple[str, bool]] = {}
    for package in SHIPPED_PACKAGES:
        module = importlib.import_module(package)
        assert module.__file__, f"{package} is imported from source files"
        directory = Path(module.__file__).parent
        sources[package] = ((directory / "__init__.py").read_text(encoding="utf-8"), True)
        if package == "clusterspec":
            continue  # only its __init__: variables.py needs yaml, which hosts may lack
        for path in sorted(directory.glob("*.py")):
            if path.name != "__init__.py":
                sources[f"{package}.{path.stem}"] = (path.read_text(encoding="utf-8"), False)
    for name in SHIPPED_MODULES:
        file = importlib.import_module(name).__file__
        assert file, f"{name} is imported from a source file"
        path = Path(file)
        sources[name] = (path.read_text(encoding="utf-8"), False)
    hostcheck = Path(__file__).with_name("hostcheck.py").read_text(encoding="utf-8")
    # A __future__ import must open the script; the shipped modules keep their own.
    hostcheck = hostcheck.replace("from __future__ import annotations\n", "", 1)
    return f"SHIPPED = {sources!r}\n{_IMPORTER}\n{hostcheck}"


def _write_markers(hosts: list[Host], token: str) -> list[Path]:
    """The file every host must see in its shared dir: proof that it is one filesystem."""
    written = []
    for shared in sorted({h.shared_dir for h in hosts}):
        marker = Path(shared) / MARKER_DIR / f"health-{token}"
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(token, encoding="utf-8")
        except OSError as error:
            raise RlmctlError(
                f"cannot write {marker} on the controller ({error.strerror}); rlmctl keeps runs "
                "and the registry on the shared filesystem: mount rlm_shared_dir here too"
            ) from None
        written.append(marker)
    return written


def host_command(host: Host, token: str, with_port: bool = True) -> str:
    config = {
        "shared_dir": host.shared_dir,
        # A local host is this machine as a one-machine cluster (the demo): its trainers run as
        # whoever runs rlmctl, and its shared directory is any directory it names.
        "shared_fs": "none" if host.is_local else host.shared_fs,
        "service_user": None if host.is_local else host.service_user,
        "shared_min_free_gib": host.shared_min_free_gib,
        "marker": f"{MARKER_DIR}/health-{token}",
        "token": token,
        "gpus": host.gpus_per_node,
        "vendor": host.gpu_vendor,
        "gpu_link": host.gpu_link,
        "python": host.python,
        "rdzv_port": host.rdzv_port if with_port else 0,
        "thresholds": THRESHOLDS,
    }
    return python_command(host.script_python, _script(), json.dumps(config))


def judge_clock(host_time: float, sent: float, received: float) -> Check:
    """Skew bounded by the round trip: a slow SSH handshake never counts as skew."""
    if host_time < sent:
        skew = host_time - sent
    elif host_time > received:
        skew = host_time - received
    else:
        skew = 0.0
    detail = f"{skew:+.2f} s vs controller (±{(received - sent) / 2:.2f} s)"
    fix = "sync the clock (chrony/NTP) on this host"
    if abs(skew) >= THRESHOLDS["clock_crit_s"]:
        return Check("clock", CRIT, detail, fix)
    if abs(skew) >= THRESHOLDS["clock_warn_s"]:
        return Check("clock", WARN, detail, fix)
    return Check("clock", OK, detail)


def judge_result(result: Result, sent: float, received: float) -> HostHealth:
    health = HostHealth(result.host, duration=result.duration)
    if result.error and result.rc is None and not result.stdout:
        health.checks.append(
            Check("reachable", CRIT, result.error, "fix SSH access, or --exclude the host")
        )
        return health
    try:
        payload = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        health.checks.append(
            Check(
                "reachable",
                CRIT,
                f"check script failed: {result.reason}",
                "install python3 on the host (the checks need it)",
            )
        )
        return health
    health.checks.append(Check("reachable", OK, f"{result.duration:.2f} s round trip"))
    health.checks.append(judge_clock(float(payload["time"]), sent, received))
    health.checks.extend(Check(**c) for c in payload["checks"])
    health.env = payload.get("env")
    return health


def judge_env(hosts: list[HostHealth]) -> None:
    """The majority environment is the reference; hosts that differ from it are critical."""
    fingerprints = {
        h.host: (h.env["python"], h.env["trainer"], h.env["torch"], h.env["freeze_sha"])
        for h in hosts
        if h.env and (c := h.check("python_env")) and c.state == OK
    }
    if len(set(fingerprints.values())) <= 1:
        return
    reference, _ = Counter(fingerprints.values()).most_common(1)[0]
    for h in hosts:
        own = fingerprints.get(h.host)
        check = h.check("python_env")
        if own is None or own == reference or check is None:
            continue
        check.state = CRIT
        check.detail = (
            f"differs from the other hosts: python/trainer/torch/freeze {'/'.join(own)} "
            f"vs {'/'.join(reference)}"
        )
        check.fix = "re-provision the training venv so every host has the same packages"


def run_checks(fleet: Fleet, hosts: list[Host] | None = None, with_port: bool = True) -> Report:
    """The fast gate on `hosts` (default: all of the fleet's)."""
    targets = fleet.hosts if hosts is None else hosts
    token = secrets.token_hex(8)
    markers = _write_markers(targets, token)
    sent: dict[str, float] = {}

    def command(host: Host) -> str:
        sent[host.name] = time.time()
        return host_command(host, token, with_port)

    received: dict[str, float] = {}
    try:
        results = fleet.run(
            command, hosts=targets, on_result=lambda r: received.__setitem__(r.host, time.time())
        )
    finally:
        for marker in markers:
            marker.unlink(missing_ok=True)
    report = Report([judge_result(r, sent[r.host], received[r.host]) for r in results])
    judge_env(report.hosts)
    return report


# The newest `rlmctl health` report, and apart from it the newest `health --deep` one (its
# communication path): `rlmctl accept` reads both, and a plain health run never replaces the deep
# record.
LAST_REPORT = "health-last.json"
LAST_DEEP_REPORT = "health-deep-last.json"


def last_report_path(shared_dir: str, deep: bool = False) -> Path:
    return Path(shared_dir) / MARKER_DIR / (LAST_DEEP_REPORT if deep else LAST_REPORT)


def save_last_report(report: dict[str, Any], shared_dir: str) -> None:
    """Keep the report for `rlmctl accept` (a report with a `deep` part also as the deep
    record). Best effort: a health run must not fail because its record could not be kept."""
    record = json.dumps({"time": time.time(), **report})
    for deep in (False, True) if "deep" in report else (False,):
        path = last_report_path(shared_dir, deep)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(record, encoding="utf-8")
            tmp.replace(path)
        except OSError:
            pass


def read_last_report(shared_dir: str, deep: bool = False) -> dict[str, Any] | None:
    try:
        report = json.loads(last_report_path(shared_dir, deep).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None

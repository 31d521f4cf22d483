"""The fast health checks, run ON a host: shipped by `rlmctl health` inside one command line.

Standard library only and Python 3.8-compatible (nodes have the system python3), no imports from
rlmctl: the file is sent as it is, together with the vendor descriptions (clusterspec.vendors:
the same tool commands, parsers and XID rules the exporter uses), see rlmctl.health. Input: one JSON argument (what to check, thresholds). Output:
one JSON object on stdout: the host's clock at start, the check results and facts the controller
compares across hosts (Python environment fingerprint). All checks run in parallel threads so a
slow one (a GPU tool, the venv's python) bounds the round trip, not the sum.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

from clusterspec import shared_dir, vendors
from clusterspec.vendors.readings import ToolError
from clusterspec.vendors.topology import judge as topology_judge

OK, WARN, CRIT, UNKNOWN = "OK", "WARN", "CRIT", "UNKNOWN"

ENV_PROBE = r"""
import hashlib, importlib.metadata as md, json, platform, sys
dists = sorted({(d.metadata['Name'] or '').lower() + '==' + d.version for d in md.distributions()})
versions = {d.split('==')[0]: d.split('==')[1] for d in dists}
try:
    import trainer
    trainer_version = trainer.__version__
except Exception as error:
    trainer_version = 'not importable: ' + type(error).__name__
print(json.dumps({'python': platform.python_version(), 'trainer': trainer_version,
                  'torch': versions.get('torch', 'missing'),
                  'freeze_sha': hashlib.sha256('\n'.join(dists).encode()).hexdigest()[:12]}))
"""


def check(name, state, detail, fix=""):
    return {"name": name, "state": state, "detail": detail, "fix": fix}


def run_tool(argv, timeout=20):
    """(rc, stdout) of a tool (stdout + stderr when it failed), or (None, why) when it is
    missing or hangs."""
    if shutil.which(argv[0]) is None:
        return None, argv[0] + " not found"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, argv[0] + " hung for " + str(timeout) + " s"
    return done.returncode, done.stdout if done.returncode == 0 else done.stdout + done.stderr


def check_disk(cfg):
    """The shared directory's properties: clusterspec.shared_dir's verdict, the same one
    playbooks/verify.yml gives (exists, owned and writable by the service user with its runs/,
    the filesystem rlm_shared_fs names, free space above the floor, use under the thresholds)."""
    return shared_dir.inspect(
        {
            "path": cfg["shared_dir"],
            "user": cfg.get("service_user"),
            "fs": cfg.get("shared_fs", "none"),
            "min_free_gib": cfg.get("shared_min_free_gib", 0),
            "thresholds": cfg["thresholds"],
        }
    )


def check_shared_fs(cfg):
    path = cfg["shared_dir"]
    marker = os.path.join(path, cfg["marker"])
    point, fstype, source = shared_dir.mount_of(path)
    where = f"{path} on {point} ({fstype} from {source})"
    try:
        with open(marker) as f:
            seen = f.read().strip()
    except OSError:
        seen = None
    if seen != cfg["token"]:
        return check(
            "shared_fs",
            CRIT,
            where + ": the controller's marker is missing, so this is NOT the shared filesystem",
            shared_dir.provide_advice(path, cfg.get("shared_fs", "none")),
        )
    return check("shared_fs", OK, where)


def check_memory(cfg):
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    total, available = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    pct = 100.0 * available / total
    detail = f"{available / 2**30:.1f} of {total / 2**30:.1f} GiB available ({pct:.0f}%)"
    fix = "stop what holds the memory (leftover trainer? rlmctl stop RUN)"
    limits = cfg["thresholds"]
    if pct < limits["mem_crit_pct"]:
        return check("memory", CRIT, detail, fix)
    if pct < limits["mem_warn_pct"]:
        return check("memory", WARN, detail, fix)
    return check("memory", OK, detail)


def check_load(cfg):
    load1 = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    detail = f"load {load1:.2f} on {cpus} CPUs"
    # Load slows training but breaks nothing: never critical.
    if load1 / cpus > cfg["thresholds"]["load_warn_per_cpu"]:
        return check("load", WARN, detail, "find the busy processes (top) before launching")
    return check("load", OK, detail)


def judge_gpus(gpus, expected, limits):
    """One check from the vendor parser's GpuReadings: count, uncorrected ECC, temperature."""
    if len(gpus) != expected:
        return check(
            "gpu",
            CRIT,
            f"{len(gpus)} GPUs visible, inventory says rlm_gpus_per_node={expected}",
            "reseat/replace the missing GPU or fix rlm_gpus_per_node; drain the host meanwhile",
        )
    drivers = sorted({g.driver or "?" for g in gpus})
    model = (gpus[0].name or "GPU") if gpus else "-"
    detail = f"{len(gpus)}× {model}, driver {'/'.join(drivers)}"
    ecc = [int(g.gpu) for g in gpus if g.ecc_uncorrected_total]
    if ecc:
        return check(
            "gpu", CRIT, detail + "; uncorrected ECC errors on GPU " + str(ecc), "drain, RMA"
        )
    hottest = max((g.temperature_celsius or 0 for g in gpus), default=0)
    detail += f"; max {hottest:.0f} C"
    if hottest >= limits["gpu_temp_crit_c"]:
        return check("gpu", CRIT, detail, "check cooling/fans before using this host")
    if hottest >= limits["gpu_temp_warn_c"]:
        return check("gpu", WARN, detail, "check cooling/fans")
    return check("gpu", OK, detail)


def host_vendor(cfg):
    """rlm_gpu_vendor, with auto resolved by the GPU driver loaded here."""
    return vendors.detect_vendor() if cfg["vendor"] == "auto" else cfg["vendor"]


def read_gpus(vendor):
    """(GpuReadings, None) from the vendor's tool, or (None, (state, detail)) when it fails."""
    description = vendors.VENDORS[vendor]
    tool = vendors.vendor_tool(vendor)
    rc, out = run_tool(list(description.TOOLS[tool]))
    if rc is None or rc != 0:
        return None, (CRIT, "GPU tool failed: " + (out.strip().splitlines() or [f"exit {rc}"])[-1])
    try:
        return description.PARSERS[tool](out).gpus, None
    except ToolError as error:
        return None, (UNKNOWN, f"cannot parse {tool} output: {error}")


def check_gpu(cfg):
    vendor = host_vendor(cfg)
    if vendor == "none":
        return check("gpu", OK, "skipped (rlm_gpu_vendor=" + cfg["vendor"] + ", no GPU driver)")
    gpus, failure = read_gpus(vendor)
    if failure:
        fix = f"install/repair the {vendor} driver (ansible-playbook playbooks/site.yml)"
        return check("gpu", failure[0], failure[1], fix if failure[0] == CRIT else "")
    return judge_gpus(gpus, cfg["gpus"], cfg["thresholds"])


def check_topology(cfg):
    """GPU x GPU links and GPU-NIC paths against the expected link (rlm_gpu_link, else the
    SKU's in the vendor description)."""
    vendor = host_vendor(cfg)
    if vendor == "none":
        return check("topology", OK, "skipped (no GPU)")
    layout = vendors.VENDORS[vendor].TOPOLOGY
    rc, out = run_tool(list(layout.COMMAND))
    if rc != 0:
        why = (out or "").strip().splitlines() or [f"exit {rc}"]
        return check("topology", UNKNOWN, " ".join(layout.COMMAND) + " failed: " + why[-1])
    try:
        topology = layout.parse(out)
    except ToolError as error:
        return check("topology", UNKNOWN, str(error))
    # Local annotations are never evaluated: safe on the nodes' python 3.8.
    expected: str | None = cfg.get("gpu_link")
    sku: str | None = "rlm_gpu_link"
    if not expected:
        gpus, _ = read_gpus(vendor)
        name = next((g.name for g in gpus or [] if g.name), None)
        expected, sku = vendors.expected_gpu_link(vendor, name or "")
        sku = sku or name
    state, detail, fix = topology_judge(topology, expected, sku)
    return check("topology", state, detail, fix)


def check_gpu_xid(cfg):
    vendor = host_vendor(cfg)
    description = vendors.VENDORS.get(vendor)
    if description is None or description.KERNEL_LOG is None:
        return check("gpu_xid", OK, f"skipped (no kernel-log rules for {vendor})")
    rc, out = run_tool(list(description.KERNEL_LOG))
    if rc != 0:
        return check("gpu_xid", UNKNOWN, "cannot read the kernel log: " + out.strip()[:120])
    codes = [code for events in description.xid_events(out).values() for code, _ in events]
    state, detail = description.judge_xids(codes)
    return check(
        "gpu_xid", state, detail, {CRIT: "drain, RMA", WARN: "watch this host"}.get(state, "")
    )


def check_rdzv_port(cfg):
    port = cfg["rdzv_port"]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Like the c10d store: connections of a just-stopped run in TIME_WAIT do not count.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as error:
            return check(
                "rdzv_port",
                CRIT,
                f"rendezvous port {port} is busy ({error.strerror})",
                "stop the leftover run (rlmctl runs; rlmctl stop RUN) or set rlm_rdzv_port",
            )
    return check("rdzv_port", OK, f"port {port} free")


def probe_env(cfg):
    rc, out = run_tool([cfg["python"], "-c", ENV_PROBE], timeout=cfg["thresholds"]["env_timeout_s"])
    if rc != 0:
        text = (out or "").strip().splitlines()
        return None, check(
            "python_env",
            CRIT,
            "{} does not run: {}".format(cfg["python"], text[-1] if text else f"exit {rc}"),
            "provision the training venv (rlm_venv) on this host",
        )
    env = json.loads(out.strip().splitlines()[-1])
    if env["trainer"].startswith("not importable"):
        return env, check(
            "python_env",
            CRIT,
            "trainer " + env["trainer"] + " in " + cfg["python"],
            "install rlm-ops into the training venv (rlm_venv)",
        )
    detail = "python {}, trainer {}, torch {}, freeze {}".format(
        env["python"],
        env["trainer"],
        env["torch"],
        env["freeze_sha"],
    )
    return env, check("python_env", OK, detail)


# Every check by the name it reports, in report order; the name is the registration, not the
# function's (a crashing check is reported under its own name, in its place).
CHECKS = (
    ("disk", check_disk),
    ("shared_fs", check_shared_fs),
    ("memory", check_memory),
    ("load", check_load),
    ("gpu", check_gpu),
    ("gpu_xid", check_gpu_xid),
    ("topology", check_topology),
    ("rdzv_port", check_rdzv_port),
    ("python_env", probe_env),
)


def main(argv):
    started = time.time()
    cfg = json.loads(argv[1])
    checks = [(n, fn) for n, fn in CHECKS if n != "rdzv_port" or cfg.get("rdzv_port")]
    results, facts = {}, {}

    def guarded(name, fn):
        try:
            if fn is probe_env:
                facts["env"], outcome = probe_env(cfg)
            else:
                outcome = fn(cfg)
        except Exception as error:  # a broken check must not hide the others
            outcome = check(name, UNKNOWN, f"{type(error).__name__}: {error}")
        results[name] = outcome

    threads = [threading.Thread(target=guarded, args=check_) for check_ in checks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ordered = [results[name] for name, _ in checks]
    print(
        json.dumps({"time": started, "hostname": socket.gethostname(), "checks": ordered, **facts})
    )


if __name__ == "__main__":
    main(sys.argv)

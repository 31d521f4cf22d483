"""The fast health checks, run ON a host: shipped by `rlmctl health` inside one command line.

Standard library only and Python 3.8-compatible (nodes have the system python3), no imports from
rlmctl: the file is sent as it is. Input: one JSON argument (what to check, thresholds). Output:
one JSON object on stdout: the host's clock at start, the check results and facts the controller
compares across hosts (Python environment fingerprint). All checks run in parallel threads so a
slow one (a GPU tool, the venv's python) bounds the round trip, not the sum.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

OK, WARN, CRIT, UNKNOWN = "OK", "WARN", "CRIT", "UNKNOWN"

# XIDs that mean the GPU (or its memory) needs draining, and ones worth a look (facts.md).
XID_CRITICAL = {48, 62, 64, 74, 79, 92, 94, 95, *range(56, 59), *range(68, 74), *range(75, 78)}
XID_CRITICAL |= {*range(80, 87), 88, 89, *range(96, 106), *range(110, 121), *range(122, 126)}
XID_WARNING = {13, 31, 43, 45, 63, 109}

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
    """(rc, stdout) of a tool, or (None, why) when it is missing or hangs."""
    if shutil.which(argv[0]) is None:
        return None, argv[0] + " not found"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, argv[0] + " hung for " + str(timeout) + " s"
    return done.returncode, done.stdout + done.stderr


def mount_of(path):
    """(mount point, fstype, source) of the filesystem holding `path`."""
    best = ("/", "?", "?")
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, fields[2], fields[0])
    except OSError:
        pass
    return best


def check_disk(cfg):
    path, limits = cfg["shared_dir"], cfg["thresholds"]
    fix_space = "free space under " + path + " (old checkpoints: rlmctl checkpoints RUN)"
    if not os.path.isdir(path):
        return check("disk", CRIT, path + " does not exist", "mount the shared filesystem there")
    probe = os.path.join(path, ".rlmctl-write-test-" + socket.gethostname() + str(os.getpid()))
    try:
        with open(probe, "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as error:
        if os.path.exists(probe):
            os.remove(probe)
        reason = "full" if error.errno == 28 else "not writable"
        return check("disk", CRIT, path + " is " + reason + ": " + error.strerror, fix_space)
    st = os.statvfs(path)
    total = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    used_pct = 100.0 * (1 - free / total) if total else 100.0
    detail = f"{path} {used_pct:.0f}% used, {free / 2**30:.1f} GiB free"
    if used_pct >= limits["disk_crit_pct"]:
        return check("disk", CRIT, detail + " (full)", fix_space)
    if used_pct >= limits["disk_warn_pct"]:
        return check("disk", WARN, detail, fix_space)
    return check("disk", OK, detail)


def check_shared_fs(cfg):
    path = cfg["shared_dir"]
    marker = os.path.join(path, cfg["marker"])
    point, fstype, source = mount_of(path)
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
            "mount the shared filesystem at "
            + path
            + " (e.g. ansible-playbook playbooks/site.yml)",
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


def parse_nvidia_smi(text):
    """Rows of `nvidia-smi --query-gpu=index,name,driver_version,temperature.gpu,
    ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 5 or not cells[0].isdigit():
            continue
        gpus.append(
            {
                "index": int(cells[0]),
                "name": cells[1],
                "driver": cells[2],
                "temp": _number(cells[3]),
                "ecc_uncorrected": _number(cells[4]),
            }
        )
    return gpus


def parse_rocm_smi(text):
    """`rocm-smi --showproductname --showdriverversion --showtemp --json` → the same row shape."""
    data = json.loads(text[text.index("{") :])
    driver = data.get("system", {}).get("Driver version", "?")
    gpus = []
    for key in sorted(k for k in data if k.startswith("card")):
        card = data[key]
        temps = [_number(v) for k, v in card.items() if k.startswith("Temperature")]
        temps = [t for t in temps if t is not None]
        gpus.append(
            {
                "index": int(key[4:]),
                "name": card.get("Card Series", card.get("Card series", "?")),
                "driver": driver,
                "temp": max(temps) if temps else None,
                "ecc_uncorrected": None,
            }
        )
    return gpus


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def judge_gpus(gpus, expected, limits):
    """One check from parsed GPU rows: count, uncorrected ECC, temperature."""
    if len(gpus) != expected:
        return check(
            "gpu",
            CRIT,
            f"{len(gpus)} GPUs visible, inventory says rlm_gpus_per_node={expected}",
            "reseat/replace the missing GPU or fix rlm_gpus_per_node; drain the host meanwhile",
        )
    drivers = sorted({g["driver"] for g in gpus})
    model = gpus[0]["name"] if gpus else "-"
    detail = f"{len(gpus)}× {model}, driver {'/'.join(drivers)}"
    ecc = [g["index"] for g in gpus if g["ecc_uncorrected"]]
    if ecc:
        return check(
            "gpu", CRIT, detail + "; uncorrected ECC errors on GPU " + str(ecc), "drain, RMA"
        )
    hottest = max((g["temp"] or 0 for g in gpus), default=0)
    detail += f"; max {hottest:.0f} C"
    if hottest >= limits["gpu_temp_crit_c"]:
        return check("gpu", CRIT, detail, "check cooling/fans before using this host")
    if hottest >= limits["gpu_temp_warn_c"]:
        return check("gpu", WARN, detail, "check cooling/fans")
    return check("gpu", OK, detail)


def detect_vendor():
    """rlm_gpu_vendor=auto: the vendor whose tool is installed; none without either."""
    if shutil.which("nvidia-smi"):
        return "nvidia"
    if shutil.which("rocm-smi"):
        return "amd"
    return "none"


def check_gpu(cfg):
    vendor, expected = cfg["vendor"], cfg["gpus"]
    if vendor == "auto":
        vendor = detect_vendor()
    if vendor == "none":
        return check("gpu", OK, "skipped (rlm_gpu_vendor=none)")
    if vendor == "nvidia":
        query = "index,name,driver_version,temperature.gpu,ecc.errors.uncorrected.volatile.total"
        rc, out = run_tool(["nvidia-smi", "--query-gpu=" + query, "--format=csv,noheader,nounits"])
        parse = parse_nvidia_smi
    else:
        argv = ["rocm-smi", "--showproductname", "--showdriverversion", "--showtemp", "--json"]
        rc, out = run_tool(argv)
        parse = parse_rocm_smi
    if rc is None or rc != 0:
        return check(
            "gpu",
            CRIT,
            "GPU tool failed: " + (out.strip().splitlines() or [f"exit {rc}"])[-1],
            f"install/repair the {vendor} driver (ansible-playbook playbooks/site.yml)",
        )
    try:
        gpus = parse(out)
    except ValueError as error:
        return check("gpu", UNKNOWN, f"cannot parse GPU tool output: {error}")
    return judge_gpus(gpus, expected, cfg["thresholds"])


def parse_xids(kernel_log):
    """XID codes from `NVRM: Xid (PCI:0000:3b:00): 79, pid=...` kernel log lines."""
    return [int(m) for m in re.findall(r"NVRM: Xid \([^)]*\): (\d+)", kernel_log)]


def judge_xids(xids):
    critical = sorted(set(xids) & XID_CRITICAL)
    if critical:
        return check("gpu_xid", CRIT, f"critical XIDs in kernel log: {critical}", "drain, RMA")
    warning = sorted(set(xids) & XID_WARNING)
    if warning:
        return check("gpu_xid", WARN, f"XIDs in kernel log: {warning}", "watch this host")
    return check("gpu_xid", OK, "no XID errors in kernel log")


def check_xid(cfg):
    vendor = detect_vendor() if cfg["vendor"] == "auto" else cfg["vendor"]
    if vendor != "nvidia":
        return check("gpu_xid", OK, "skipped (NVIDIA only)")
    rc, out = run_tool(["dmesg", "--notime"])
    if rc != 0:
        return check("gpu_xid", UNKNOWN, "cannot read the kernel log: " + out.strip()[:120])
    return judge_xids(parse_xids(out))


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


def main(argv):
    started = time.time()
    cfg = json.loads(argv[1])
    checks = [check_disk, check_shared_fs, check_memory, check_load, check_gpu, check_xid]
    if cfg.get("rdzv_port"):
        checks.append(check_rdzv_port)
    results, facts = [], {}

    def guarded(fn):
        try:
            if fn is probe_env:
                facts["env"], outcome = probe_env(cfg)
            else:
                outcome = fn(cfg)
        except Exception as error:  # a broken check must not hide the others
            name = fn.__name__.replace("check_", "").replace("probe_", "python_")
            outcome = check(name, UNKNOWN, f"{type(error).__name__}: {error}")
        results.append(outcome)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in [*checks, probe_env]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    order = [fn.__name__.replace("check_", "") for fn in checks] + ["python_env"]
    results.sort(key=lambda c: order.index(c["name"]) if c["name"] in order else len(order))
    print(
        json.dumps({"time": started, "hostname": socket.gethostname(), "checks": results, **facts})
    )


if __name__ == "__main__":
    main(sys.argv)

"""Start, inspect and stop a run's processes ON a host; shipped by rlmctl inside the command line.

Standard library only, Python 3.8-compatible, no rlmctl imports. Argument: one base64-encoded JSON
object (base64 so that no process's command line contains the run's path except the run's own).

A run's processes on a host are found by their environment: rlmctl starts the launcher with
RLMCTL_RUN=<run dir> and RLMCTL_HOST=<inventory name>, which every child inherits, including
torchrun's workers that sit in sessions of their own and would be orphaned by killing torchrun
alone. The process group recorded at start is a second handle on the same processes.

Where the host runs systemd, this runs as root and the trainer's slice is installed (roles/common:
rlm-trainer.slice, with the site's MemoryMax, CPUWeight and TasksMax), the launcher starts in a
transient unit of its own in that slice (`systemd-run --slice --unit`, Delegate=yes so torch and
its workers may manage sub-cgroups); elsewhere it starts detached in a session of its own.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

# The launcher shell survives SIGTERM (`trap :`) so that it can record how the attempt ended.
# torchrun does not pass the trainer's exit code on (a failed worker makes it exit 1, and so
# does a clean SIGTERM stop): the training environment's python takes the attempt's code from
# the run directory (`python -m runcontract.attempt`: the trainer's own before torchrun's, into
# hosts/<host>/exit.json) and the shell exits with it. Should that python fail, the shell records
# torchrun's code itself and, if it is not 0, `launch_failed`: the run must not stay `launching`.
WRAPPER = r"""
"$@" &
child=$!
trap : TERM INT HUP
while :; do
  wait "$child"; rc=$?
  kill -0 "$child" 2>/dev/null || break
done
if [ -n "$RLMCTL_PYTHON" ] && code=$("$RLMCTL_PYTHON" -m runcontract.attempt \
    "$RLMCTL_RUN" "$RLMCTL_HOST" "$rc") && [ -n "$code" ]; then
  exit "$code"
fi
now=$(date +%s)
printf '{"exit_code": %d, "time": %s}\n' "$rc" "$now" > "$RLMCTL_EXIT_FILE.tmp"
mv "$RLMCTL_EXIT_FILE.tmp" "$RLMCTL_EXIT_FILE"
if [ -n "$RLMCTL_PYTHON" ] && [ "$rc" != 0 ]; then
  printf '{"event": "launch_failed", "time": %s, "exit_code": %d, "reason": "%s"}\n' \
    "$now" "$rc" "torchrun ended with $rc; the training environment could not record it" \
    >> "$RLMCTL_RUN/events.jsonl"
fi
exit "$rc"
"""


SLICE = "rlm-trainer.slice"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def read_proc(pid):
    """(ppid, pgid, state, environ bytes) or None when the process is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[2]), fields[0], environ


def ancestors():
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return pids


def run_processes(cfg):
    """Live (non-zombie) processes of the run on this host: [(pid, cmdline)]."""
    wanted_run = ("RLMCTL_RUN=" + cfg["run_dir"]).encode()
    wanted_host = ("RLMCTL_HOST=" + cfg["host"]).encode()
    pgid = cfg.get("pgid")
    mine = ancestors()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine or entry == "1":
            continue  # never this script's own ancestors, never the init system
        info = read_proc(int(entry))
        if info is None or info[2] == "Z":
            continue
        variables = info[3].split(b"\0")
        ours = wanted_run in variables and wanted_host in variables
        if ours or (pgid and info[1] == pgid):
            found.append(int(entry))
    return [(pid, cmdline(pid)) for pid in found]


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return ""


def signal_all(pids, sig):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def trainer_slice(cfg):
    """The slice to start the launcher in, or None for the detached start."""
    name = cfg.get("slice", SLICE)
    if not os.path.isdir("/run/systemd/system") or os.geteuid() != 0:
        return None  # PID 1 is not systemd, or no right to add system units
    if shutil.which("systemd-run") is None or shutil.which("systemctl") is None:
        return None
    probe = subprocess.run(
        ["systemctl", "show", "--property=LoadState", "--value", name],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    return name if probe.stdout.strip() == "loaded" else None


def unit_name(cfg):
    """rlm-run-<run>-<host>-<ms>.service: one per start, so a resume never meets the old unit."""
    run = os.path.basename(cfg["run_dir"].rstrip("/"))
    name = f"rlm-run-{run}-{cfg['host']}-{int(time.time() * 1000)}"
    return re.sub(r"[^A-Za-z0-9:_.-]", "_", name)[:240] + ".service"


def start(cfg):
    os.makedirs(os.path.dirname(cfg["log"]), exist_ok=True)
    env = dict(os.environ)
    env.update(cfg["env"])
    env["RLMCTL_EXIT_FILE"] = cfg["exit_file"]
    if cfg.get("python"):  # the training environment's, which ends the attempt
        env["RLMCTL_PYTHON"] = cfg["python"]
    with contextlib.suppress(FileNotFoundError):
        os.remove(cfg["exit_file"])
    launcher = ["/bin/sh", "-c", WRAPPER, "rlmctl-launcher", *cfg["argv"]]
    slice_name = trainer_slice(cfg)
    if slice_name:
        return start_unit(cfg, slice_name, env, launcher)
    with open(cfg["log"], "ab") as log, open(os.devnull, "rb") as devnull:
        process = subprocess.Popen(
            launcher,
            stdin=devnull,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cfg["cwd"],
            env=env,
            start_new_session=True,  # own session and process group: survives the SSH session
        )
    return {"pid": process.pid, "pgid": os.getpgid(process.pid), "started": time.time()}


def start_unit(cfg, slice_name, env, launcher):
    """The launcher as a transient service in the trainer's slice; it outlives the SSH session
    because systemd, not this shell, is its parent. Its environment is passed whole (a unit
    starts with an empty one), but for names systemd refuses (exported shell functions)."""
    unit = unit_name(cfg)
    argv = [
        "systemd-run",
        "--quiet",
        "--collect",  # unloaded once it ends, failed or not
        "--unit=" + unit,
        "--slice=" + slice_name,
        "--property=Delegate=yes",
        "--property=StandardOutput=append:" + cfg["log"],
        "--property=StandardError=append:" + cfg["log"],
        "--working-directory=" + cfg["cwd"],
    ]
    argv += [f"--setenv={k}={v}" for k, v in sorted(env.items()) if ENV_NAME.match(k)]
    subprocess.run([*argv, "--", *launcher], check=True, stdin=subprocess.DEVNULL)
    shown = subprocess.run(
        ["systemctl", "show", "--property=MainPID", "--value", unit],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    # No process group: until systemd's child has called setsid() it is still in PID 1's group,
    # and stop would signal PID 1. The environment alone finds the unit's processes.
    pid = int(shown.stdout.strip() or 0)
    return {"pid": pid, "pgid": None, "started": time.time(), "unit": unit, "slice": slice_name}


def status(cfg):
    """The run is alive on this host while its launcher shell is: it outlives torchrun only
    long enough to record the exit code, so orphaned workers never count as a live run."""
    processes = run_processes(cfg)
    launcher = cfg.get("pid")
    alive = any(pid == launcher for pid, _ in processes) if launcher else bool(processes)
    return {"alive": alive, "processes": processes}


def parent_pid(pid):
    info = read_proc(pid)
    return info[0] if info else None


def pid_namespace(pid):
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def stop_targets(processes):
    """Whom a stop's SIGTERM goes to: each root of the run's process tree on this host (the
    launcher shell, or a worker whose torchrun is gone) and the roots' children (torchrun).
    Not torchrun's workers: torchrun forwards the signal to them, and a worker that got it twice
    would take the second as "exit now" and skip its checkpoint (trainer/stop_signals.py). Not a
    container's processes either (rlm_container_image: another PID namespace): `podman run`, a
    child of the launcher shell, passes the signal on to the container's first process
    (torchrun), whose parent (conmon) is not the run's, so it would count as a root."""
    own = pid_namespace("self")
    pids = {pid for pid, _ in processes if pid_namespace(pid) in (own, None)}
    parents = {pid: parent_pid(pid) for pid in pids}
    roots = {pid for pid, parent in parents.items() if parent not in pids}
    return sorted(pid for pid, parent in parents.items() if pid in roots or parent in roots)


def stop(cfg):
    """SIGTERM to the roots of the run's processes and their children, wait up to the timeout
    for a clean exit, then SIGKILL whatever is left."""
    before = run_processes(cfg)
    signal_all(stop_targets(before), signal.SIGTERM)
    deadline = time.time() + cfg["timeout"]
    remaining = run_processes(cfg)
    while remaining and time.time() < deadline:
        time.sleep(0.2)
        remaining = run_processes(cfg)
    killed = []
    if remaining:
        killed = remaining
        signal_all([pid for pid, _ in remaining], signal.SIGKILL)
        deadline = time.time() + 10
        while remaining and time.time() < deadline:
            time.sleep(0.1)
            remaining = run_processes(cfg)
    return {"found": len(before), "killed": killed, "remaining": remaining}


def targets(cfg):
    """What `stop` would signal now, signalling nothing (`rlmctl stop --dry-run`): the SIGTERM
    targets and every process of the run (SIGKILL for whatever of them outlives the timeout)."""
    processes = run_processes(cfg)
    names = dict(processes)
    return {"term": [[pid, names[pid]] for pid in stop_targets(processes)], "processes": processes}


def main(argv):
    cfg = json.loads(base64.b64decode(argv[2]))
    action = {"start": start, "status": status, "stop": stop, "targets": targets}[argv[1]]
    print(json.dumps(action(cfg)))


if __name__ == "__main__":
    main(sys.argv)

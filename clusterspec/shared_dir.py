"""What the shared directory (rlm_shared_dir) must be on a node, judged ON the node.

One description for both `rlmctl health` (its `disk` check: rlmctl/hostcheck.py, shipped with this
module) and `playbooks/verify.yml` (runs this file with the node's python3), so that both give
the same verdict and the same advice: the directory exists, it and its `runs/` belong to the
service user, that user can write there, it is the filesystem `rlm_shared_fs` names (lustre;
`none`: whatever the site mounted), its free space is above the floor and its use under the
thresholds. The advice follows `rlm_shared_fs`: with `none` rlm-ops mounts nothing, so it never
says "run site.yml to mount it".

Standard library only, Python 3.8+ (nodes run it with their system python3).

    python3 shared_dir.py '{"path": "/lustre", "user": "rlm", "fs": "lustre", "min_free_gib": 10}'
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from typing import Any

OK, WARN, CRIT = "OK", "WARN", "CRIT"
# Use of the filesystem: WARN and CRIT at these percentages (fleet practice: >= 95 % is critical).
THRESHOLDS = {"disk_warn_pct": 90, "disk_crit_pct": 95}
PROBE_BYTES = 4096
# Run as the service user: create, write, fsync and remove a file in each directory given.
WRITE_PROBE = r"""
import os, socket, sys
for directory in sys.argv[1:]:
    path = os.path.join(directory, ".rlm-write-check-%s-%d" % (socket.gethostname(), os.getpid()))
    try:
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        print(directory)
        print(error.strerror)
        sys.exit(1)
    finally:
        if os.path.exists(path):
            os.remove(path)
"""


def mount_of(path: str) -> tuple[str, str, str]:
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


def provide_advice(path: str, fs: str) -> str:
    """How to make `path` exist as the shared filesystem, for the site's rlm_shared_fs."""
    if fs == "lustre":
        return (
            "mount Lustre at " + path + ": ansible-playbook playbooks/site.yml --tags lustre "
            "(rlm_shared_fs: lustre; the lustre_client role mounts it)"
        )
    return (
        "mount the site's shared filesystem (NFS, ...) at " + path + " on this node: with "
        "rlm_shared_fs: none rlm-ops mounts nothing, so site.yml cannot do it"
    )


def owner_advice(path: str, user: str, fs: str, paths: list[str]) -> str:
    targets = " ".join(paths)
    if fs == "lustre":
        return (
            "chown " + user + ": " + targets + " once, from any client (the filesystem root's "
            "owner is Lustre's, not the role's)"
        )
    return (
        "chown "
        + user
        + ": "
        + targets
        + " (site.yml does it: --tags users_ssh gives "
        + path
        + " and its runs/ to the service user)"
    )


def write_check(directories: list[str], user: pwd.struct_passwd) -> tuple[str, str] | None:
    """None when `user` can write in every directory, else (the first directory it cannot write
    in, why). As root: tried as that user for real; as the user itself: directly; as anyone else:
    judged by the mode bits."""
    me = os.geteuid()
    if me == user.pw_uid or (me == 0 and sys.version_info >= (3, 9)):
        argv = [sys.executable, "-c", WRITE_PROBE, *directories]
        kwargs: dict[str, Any] = {}
        if me != user.pw_uid:
            groups = os.getgrouplist(user.pw_name, user.pw_gid)
            kwargs = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": groups}
        try:
            done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=60, **kwargs)
        except OSError:  # this interpreter is not the user's to run (a private install)
            done = None
        if done is not None and done.returncode != 0:
            said = done.stdout.splitlines()
            if len(said) == 2:
                return said[0], said[1]
            return directories[0], "the write probe exited " + str(done.returncode)
        if done is not None:
            return None
    for directory in directories:
        st = os.stat(directory)
        if not (st.st_uid == user.pw_uid and st.st_mode & 0o300 == 0o300) and st.st_mode & 3 != 3:
            return directory, "mode " + oct(st.st_mode & 0o7777) + " (by its mode bits)"
    return None


def inspect(cfg: dict[str, Any]) -> dict[str, str]:
    """The verdict on cfg["path"]: {"name", "state", "detail", "fix"}, the health check's shape.

    cfg: path, user (the service user; None: whoever runs the check, e.g. a local demo), fs
    (rlm_shared_fs: lustre or none), min_free_gib (floor), optional thresholds
    (disk_warn_pct, disk_crit_pct; default THRESHOLDS). CRIT when a property fails; WARN when
    the use is high or the service user does not exist here (not provisioned: its ownership
    cannot be judged, and whoever runs the check must be able to write instead).
    """
    path, fs, user_name = cfg["path"], cfg.get("fs", "none"), cfg.get("user")
    limits = dict(
        THRESHOLDS, **{k: v for k, v in (cfg.get("thresholds") or {}).items() if k in THRESHOLDS}
    )
    findings: list[tuple[str, str, str | None]] = []  # (state, problem, fix)
    if not os.path.isdir(path):
        findings.append((CRIT, path + " does not exist", provide_advice(path, fs)))
        return _verdict(findings, "")
    point, fstype, source = mount_of(path)
    if fs == "lustre" and fstype != "lustre":
        problem = path + " is on " + fstype + " (" + source + " at " + point + "), not lustre"
        findings.append((CRIT, problem, provide_advice(path, fs)))
    user = None
    if user_name:
        try:
            user = pwd.getpwnam(user_name)
        except KeyError:
            fix = "run site.yml (users_ssh creates " + user_name + " with its pinned uid)"
            findings.append((WARN, "the service user " + user_name + " does not exist here", fix))
    runs = os.path.join(path, "runs")
    directories = [path] + ([runs] if os.path.isdir(runs) else [])
    strangers: list[tuple[str, str]] = []
    for directory in directories:
        uid = os.stat(directory).st_uid
        if user is not None and uid != user.pw_uid:
            try:
                owner = pwd.getpwuid(uid).pw_name
            except KeyError:
                owner = "uid " + str(uid)
            strangers.append((directory, owner))
    if user is not None and strangers:
        problem = "; ".join(d + " is owned by " + o + ", not " + user.pw_name for d, o in strangers)
        fix = owner_advice(path, user.pw_name, fs, [d for d, _ in strangers])
        findings.append((CRIT, problem, fix))
    writer = user or pwd.getpwuid(os.geteuid())
    failed = write_check(directories, writer)
    if failed:
        directory, why = failed
        # A directory of the wrong owner: giving it to the user (the fix above) is the fix.
        owned_wrong = directory in [d for d, _ in strangers]
        fix = None if owned_wrong else "give " + writer.pw_name + " write access to " + directory
        findings.append((CRIT, writer.pw_name + " cannot write in " + directory + ": " + why, fix))
    st = os.statvfs(path)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    used_pct = 100.0 * (1 - free / total) if total else 100.0
    usage = f"{path} {used_pct:.0f}% used, {free / 2**30:.1f} GiB free"
    floor = float(cfg.get("min_free_gib") or 0)
    fix_space = "free space under " + path + " (old checkpoints: rlmctl checkpoints RUN)"
    if free < floor * 2**30:
        floor_text = f", under the floor of {floor:g} GiB (rlm_shared_min_free_gib)"
        findings.append((CRIT, usage + floor_text, fix_space))
    elif used_pct >= limits["disk_crit_pct"]:
        findings.append((CRIT, usage + " (full)", fix_space))
    elif used_pct >= limits["disk_warn_pct"]:
        findings.append((WARN, usage, fix_space))
    owner = " owned by " + user.pw_name if user and not strangers else ""
    return _verdict(findings, usage + " (" + fstype + ")" + owner)


def _verdict(findings: list[tuple[str, str, str | None]], healthy: str) -> dict[str, str]:
    """One check: the worst state, every problem in one line, each fix once."""
    rank = {OK: 0, WARN: 1, CRIT: 2}
    state = max((f[0] for f in findings), key=lambda name: rank[name], default=OK)
    fixes: list[str] = []
    for _, _, fix in findings:
        if fix and fix not in fixes:
            fixes.append(fix)
    detail = "; ".join(f[1] for f in findings) if state == CRIT else healthy
    if state == WARN:
        detail = "; ".join([healthy] + [f[1] for f in findings if f[1] not in healthy])
    return {"name": "disk", "state": state, "detail": detail, "fix": "; ".join(fixes)}


if __name__ == "__main__":
    print(json.dumps(inspect(json.loads(sys.argv[1]))))

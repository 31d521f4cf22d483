"""The `run` label of a host's GPU series comes from the trainer workers on it: rlm-exporter's
rlm_run_workers (each worker's `run_dir=`), which monitoring/prometheus/rules/gpu.yml turns into
rlm:host_run and joins onto every rlm:gpu_* series and GPU alert (GpuMissing, GpuXidCritical, ...).

Here the workers are started by rlmctl's SSH backend itself (Backend.start: hostproc's launcher
shell, torchrun, `-m trainer train`), as root, the way a systemd node runs them (a transient unit
of rlm-trainer.slice), and the exporter reads them as an unprivileged user, the way its unit runs
(User=rlm-exporter). The worker blocks reading its config (a FIFO): a real, live trainer worker
that costs no CPU while it is read.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from clusterspec.inventory import Host
from rlmctl.backend import Attempt, Placement
from rlmctl.backend_ssh import Backend, hostproc_command
from rlmctl.context import Context, Site
from runcontract.rundir import RunDir
from tests.monitoring.conftest import Samples, parse, value, wait_for
from tests.ports import free_port

RUN = "exp-join"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="starts the trainer as root and reads it as another user"
)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[tuple[Host, RunDir]]:
    """Run RUN on this machine (a one-host inventory, local connection) as `rlmctl launch`
    starts it over SSH; stopped as `rlmctl stop` stops it."""
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    (tmp_path / "shared").mkdir()
    (inventory / "hosts.yml").write_text(
        "all:\n"
        "  hosts:\n"
        "    localhost:\n"
        "  vars:\n"
        "    ansible_connection: local\n"
        "    rlm_gpu_vendor: none\n"
        "    rlm_gpus_per_node: 1\n"
        '    rlm_shared_dir: "{{ inventory_dir }}/../shared"\n'
        f"    rlm_rdzv_port: {free_port()}\n",
        encoding="utf-8",
    )
    with Context(Site(str(inventory))) as ctx:
        host = ctx.hosts[0]
        run = RunDir(host.runs_dir / RUN).create()
        os.mkfifo(run.config_path)
        placement = Placement(hosts=[host], nodes=1, gpus_per_node=1, template=host)
        launched = Backend(ctx).start(run, placement, Attempt("launch"), lambda _: None)
        assert launched.processes and not launched.failures, launched.failures
        try:
            yield host, run
        finally:
            stop = {"run_dir": str(run.path), "host": host.name, "pgid": None, "timeout": 10}
            ctx.fleet.run(hostproc_command(host, "stop", stop))


def workers(run: RunDir) -> list[int]:
    """The run's trainer workers as root sees them: what torchrun started for it (each worker
    is `python -u -m trainer train ...`), not the launcher shell, not torchrun itself."""
    found = []
    for process in psutil.process_iter(["cmdline", "environ"]):
        argv, env = process.info["cmdline"] or [], process.info["environ"] or {}
        if env.get("RLMCTL_RUN") == str(run.path) and argv[1:5] == ["-u", "-m", "trainer", "train"]:
            found.append(process.pid)
    return found


def exporter_once(user: pwd.struct_passwd | None) -> Samples:
    """One scrape of `rlm-exporter --once`, as `user` (None: as root). The modules are imported
    before the user changes: this interpreter may sit where that user cannot read."""
    drop = f"os.setgroups([]); os.setgid({user.pw_gid}); os.setuid({user.pw_uid})\n" if user else ""
    code = (
        "import os, sys\n"
        "from monitoring import exporter\n"
        f"{drop}"
        "sys.exit(exporter.main(['--once', '--gpu-source', 'none']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return parse(done.stdout)


def test_a_worker_started_by_the_ssh_backend_counts_for_its_run_as_the_exporter_sees_it(
    started: tuple[Host, RunDir],
) -> None:
    host, run = started
    log = run.launcher_log_path(host.name)
    pids = wait_for(
        lambda: workers(run),
        180,  # torchrun and the worker each import torch first; slow on a loaded machine
        lambda: (
            "the trainer worker; launcher log: "
            + (log.read_text(errors="replace")[-1500:] if log.exists() else "(none)")
        ),
    )
    assert len(pids) == 1, pids  # one worker per GPU, rlm_gpus_per_node: 1
    # As root (what an unsandboxed exporter sees) and as an unprivileged user (the role's unit).
    seen = {
        user.pw_name if user else "root": exporter_once(user)
        for user in (None, pwd.getpwnam("nobody"))
    }
    # The worker, and neither the launcher shell nor torchrun (whose command lines also hold
    # `-m trainer train ... run_dir=`), once, whoever reads it.
    counted = {who: value(samples, "rlm_run_workers", run=RUN) for who, samples in seen.items()}
    assert counted == {"root": 1, "nobody": 1}, counted
    rss = {
        who: value(samples, "rlm_trainer_resident_memory_bytes", pid=str(pids[0]))
        for who, samples in seen.items()
    }
    assert all(v and v > 1e6 for v in rss.values()), rss

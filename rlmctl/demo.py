"""`rlmctl demo` (`make demo`): the whole operator flow on this machine, in a few minutes.

It takes the same code path as a real cluster (inventory → health gate → run directory → detached
torchrun through the host's connection, here ansible_connection=local) with the tiny model, two
CPU workers and the embedded corpus, then shows what an operator looks at afterwards.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlmctl import lifecycle
from rlmctl.backend import Backend, LaunchRequest
from rlmctl.context import Context
from rlmctl.errors import RlmctlError
from runcontract.rundir import RunDir
from runcontract.states import RunState

CONFIG = Path(__file__).resolve().parents[1] / "trainer" / "configs" / "demo.yaml"
POLL_S = 1.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_data(shared_dir: Path, say: Any) -> Path:
    data = shared_dir / "data"
    say(f"preparing the embedded corpus into {data} (python -m trainer prepare)")
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "prepare", "--out", str(data), "--seq-len", "64"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise RlmctlError(f"data preparation failed: {lines[-1] if lines else done.returncode}")
    return data


def run(session: Context, steps: int, quiet: bool = False) -> dict[str, Any]:
    """The demo; returns its outcome (`exit_code`, the run, its state, the last validation
    perplexity per depth, the acceptance verdict). `quiet`: everything shown goes to stderr
    (`rlmctl demo --json` prints the outcome on stdout)."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(highlight=False, stderr=quiet)

    def say(message: str) -> None:
        console.print(message, markup=False, soft_wrap=True)

    hosts = session.hosts
    if not CONFIG.is_file():
        raise RlmctlError(f"{CONFIG} is missing; the demo needs the trainer's demo config")
    shared = Path(hosts[0].shared_dir)
    shared.mkdir(parents=True, exist_ok=True)
    data = prepare_data(shared, say)
    port = _free_port()
    name = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = [f"data.path={data}", f"train.steps={steps}", f"metrics.port={port}"]
    _health(session, say)
    backend = lifecycle.backend_for(session)
    request = LaunchRequest(CONFIG, overrides, name)
    launched = lifecycle.launch(session, backend, request, say)
    run_dir = RunDir(launched.run_dir)
    say(f"metrics: http://localhost:{port}/metrics (while it runs)")
    say(f"logs:    {run_dir.launcher_log_path(hosts[0].name)}  (rlmctl logs {name} -f)")
    outcome: dict[str, Any] = {"run": name, "run_dir": str(run_dir.path)}
    try:
        state = _follow(backend, run_dir, steps, Progress, console)
    except KeyboardInterrupt:
        say("interrupted: stopping the run (the trainer saves a checkpoint first)")
        lifecycle.stop(session, backend, name, timeout=30)
        return outcome | {"exit_code": 130, "state": "interrupted"}
    _report(run_dir, name, state, console)
    verdict = _accept(run_dir, name, hosts[0], show=not quiet)
    validation = [r for r in run_dir.read_metrics() if r.get("kind") == "val"]
    return outcome | {
        "exit_code": 0 if state is RunState.DONE else 1,
        "state": state.value,
        "step": run_dir.status().step,
        "perplexity_by_depth": validation[-1]["perplexity"] if validation else {},
        "checkpoints": [info.path.name for info in run_dir.checkpoints() if info.valid],
        "acceptance": verdict.as_dict(),
    }


def _health(session: Context, say: Any) -> None:
    """`rlmctl health --deep` before the launch: its report is what `accept` reads for the
    topology and the communication path."""
    from rlmctl import deep, health

    say("health --deep: the gate, then a real all-reduce across the workers")
    hosts = session.hosts
    report = health.run_checks(session.fleet)
    result = deep.run(session.fleet, [h for h in hosts if h.name in report.healthy])
    health.save_last_report(report.as_dict() | {"deep": result.as_dict()}, hosts[0].shared_dir)
    say(result.summary())


def _accept(run_dir: RunDir, name: str, host: Any, show: bool) -> Any:
    """The go-live report of the demo run (rlmctl accept), with the inventory's CPU thresholds."""
    from rlmctl import accept, render

    verdict = accept.run(
        name, run_dir, accept.prometheus_api(host), host.accept_thresholds, host.shared_dir
    )
    if show:
        render.acceptance(verdict)
    return verdict


def _follow(
    backend: Backend, run_dir: RunDir, steps: int, progress_cls: Any, console: Any
) -> RunState:
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("training"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with progress_cls(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=steps, detail="starting torchrun")
        while True:
            status = run_dir.status()
            detail = ""
            if status.loss is not None:
                detail = f"loss {status.loss:.3f}  {status.tokens_per_s or 0:,.0f} tok/s"
            progress.update(task, completed=status.step or 0, detail=detail or "starting torchrun")
            if status.state is not None and status.state.ended:
                return status.state
            if not backend.probe(run_dir).running:
                state = run_dir.status().state
                return state if state in (RunState.DONE, RunState.STOPPED) else RunState.FAILED
            time.sleep(POLL_S)  # display refresh


def _report(run_dir: RunDir, name: str, state: RunState, console: Any) -> None:
    from rich.table import Table

    def say(message: str) -> None:
        console.print(message, markup=False, soft_wrap=True)

    say(f"run {name}: {state}")
    validation = [r for r in run_dir.read_metrics() if r.get("kind") == "val"]
    if validation:
        last = validation[-1]
        table = Table(title=f"validation perplexity at step {last['step']}")
        table.add_column("recurrence depth")
        table.add_column("perplexity")
        for depth, value in sorted(last["perplexity"].items(), key=lambda kv: int(kv[0])):
            table.add_row(depth, f"{value:.1f}")
        console.print(table)
    checkpoints = Table(title="checkpoints")
    for column in ("step", "valid", "size", "directory"):
        checkpoints.add_column(column)
    for info in run_dir.checkpoints():
        valid = "yes" if info.valid else f"no: {info.reason}"
        size = f"{info.size_bytes / 2**20:.1f} MiB"
        checkpoints.add_row(str(info.step), valid, size, info.path.name)
    console.print(checkpoints)
    if state is RunState.DONE:
        _depth_plot(run_dir, say)
    say(f"run directory: {run_dir.path} (checkpoints under checkpoints/)")
    say(
        f"next: rlmctl status {name} | rlmctl logs {name} | rlmctl checkpoints {name} --verify"
        f" | rlmctl accept {name}"
    )
    if state is not RunState.DONE:
        say(f"the run did not finish; see rlmctl logs {name}")


def _depth_plot(run_dir: RunDir, say: Any) -> None:
    """Test-time compute: the final checkpoint's validation perplexity against depth, as a PNG
    (the trainer's `evaluate` in a subprocess: rlmctl never imports torch)."""
    latest = run_dir.latest_valid_checkpoint()
    if latest is None:
        return
    plot = run_dir.path / "perplexity-vs-depth.png"
    command = [sys.executable, "-m", "trainer", "evaluate", str(latest.path)]
    command += ["--depths", "1,2,4,8,16", "--plot", str(plot)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        say(f"evaluate at several depths failed: {result.stderr.strip()[-300:]}")
        return
    say(f"test-time compute, {latest.path.name} (python -m trainer evaluate):")
    say(result.stdout.strip())

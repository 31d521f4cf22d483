"""rlmctl's output for people and for scripts, on one local inventory with run directories made
here: every table within 80 (and 200) columns with nothing cut, `--json` on every command with
numbers as numbers, `--version`, shell completion, help without hard line breaks and with the
global options, progress bars on stderr, `--dry-run` printing exactly what launch starts, and
`rlmctl slurm` printing the very script launch submits.

The commands run in this process through the same Click group `rlmctl` runs (`rlmctl.cli.cli`),
which saves a Python start per command; the few that need a real exit path run as `rlmctl`."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlmctl.cli import GLOBAL_PANEL, cli, hoist_global_options, version
from runcontract.rundir import RunDir, write_json_atomic
from tests.ports import free_port
from tests.rlmctl.conftest import REPO, SUBMITTER, rlmctl
from tests.rlmctl.test_accept import make_run

LONG_RUN = "huginn-3.5b-h100x512-lr3e-4-warmup2000-seq4096-2026-12-02T21-30"  # 62 characters
STOPPED_RUN = "stopped-mid-way"
COMMANDS = list(cli().commands)  # every command rlmctl has


def invoke(*args: str, columns: int = 80, env: dict[str, str] | None = None):
    result = CliRunner().invoke(
        cli(), hoist_global_options(list(args)), env={"COLUMNS": str(columns), **(env or {})}
    )
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def write_inventory(root: Path, scheduler: str = "ssh", venv: str | None = None) -> Path:
    path = root / f"inventory-{scheduler}.yml"
    path.write_text(
        "all:\n  children:\n    mgmt:\n      hosts:\n        localhost:\n"
        "    compute:\n      hosts:\n        localhost:\n"
        "  vars:\n    ansible_connection: local\n    rlm_gpu_vendor: none\n"
        f"    rlm_gpus_per_node: 2\n    rlm_shared_dir: {root / 'shared'}\n"
        f"    rlm_rdzv_port: {free_port()}\n    rlm_scheduler: {scheduler}\n"
        + (f"    rlm_venv: {venv}\n" if venv else "")
    )
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local inventory and two indexed runs: LONG_RUN (done, two checkpoints, validation at
    two depths) and STOPPED_RUN (stopped before its last step, resumable)."""
    root = tmp_path_factory.mktemp("output")
    (root / "shared" / "runs").mkdir(parents=True)
    inventory = write_inventory(root)
    for name in (LONG_RUN, STOPPED_RUN):
        run_dir = make_run(root / "shared" / "runs" / name)
        run_dir.config_path.write_text((REPO / "trainer/configs/tiny.yaml").read_text())
        record = {"host": "localhost", "address": "localhost", "pid": 2**22 + 1, "pgid": None}
        record |= {"rdzv_id": f"{name}-1-abcdef", "kind": "launch", "argv": ["torchrun"]}
        run_dir.host_dir("localhost").mkdir(parents=True)
        run_dir.launcher_log_path("localhost").write_text("step 1 ...\n")
        write_json_atomic(run_dir.launch_record_path("localhost"), record)
    stopped = RunDir(root / "shared" / "runs" / STOPPED_RUN)
    stopped.append_event("start", step=150, world_size=2)
    stopped.append_event("exit", exit_code=0, state="stopped", step=160)
    assert invoke("-i", str(inventory), "reindex").exit_code == 0
    return inventory


def tables_fit(output: str, width: int) -> None:
    """Nothing cut (no ellipsis) and every table within `width`: a table's header rule spans
    the table, so no rule may be wider. (Where a row's kept cells cannot stand side by side,
    rlmctl prints the row as lines instead of a table.)"""
    assert "…" not in output, output
    rules = [line for line in output.splitlines() if line.strip() and set(line.strip()) <= {"─"}]
    assert all(len(rule.rstrip()) <= width for rule in rules), output


@pytest.mark.parametrize("columns", [80, 200])
def test_tables_fit_without_cutting_what_is_copied(site: Path, columns: int) -> None:
    inventory = str(site)
    shown = {
        "accept": invoke("-i", inventory, "accept", LONG_RUN, columns=columns).output,
        "runs": invoke("-i", inventory, "runs", columns=columns).output,
        "checkpoints": invoke("-i", inventory, "checkpoints", LONG_RUN, columns=columns).output,
        "status": invoke("-i", inventory, "status", LONG_RUN, columns=columns).output,
        "inventory": invoke("-i", inventory, "inventory", columns=columns).output,
        "health": invoke("-i", inventory, "health", columns=columns).output,
    }
    for output in shown.values():
        tables_fit(output, columns)
    # What an operator copies is whole on one line: the run name, the checkpoint directories
    # relative to the run directory, the fix of a criterion with a note.
    assert any(LONG_RUN in line.split() for line in shown["runs"].splitlines())
    for step in (100, 200):
        assert f"checkpoints/step-{step:08d}" in shown["checkpoints"]
    notes = [
        line for line in shown["accept"].splitlines() if line.startswith("communication path (")
    ]
    assert len(notes) == 1 and notes[0].endswith(("`rlmctl health --deep`", "run it")), notes
    assert any(line.split()[:1] == ["localhost"] for line in shown["health"].splitlines())


def no_numbers_as_strings(data, path: str = "") -> None:
    """Numbers are JSON numbers: no string value that is just a number."""
    if isinstance(data, dict):
        for key, value in data.items():
            no_numbers_as_strings(value, f"{path}.{key}")
    elif isinstance(data, list):
        for index, value in enumerate(data):
            no_numbers_as_strings(value, f"{path}[{index}]")
    elif isinstance(data, str):
        assert not re.fullmatch(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?", data.strip()), (path, data)


def test_json_on_every_command_with_typed_values(site: Path, tmp_path: Path) -> None:
    inventory = str(site)
    config = str(REPO / "trainer/configs/tiny.yaml")
    outputs = {
        "inventory": ("inventory",),
        "health": ("health",),
        "accept": ("accept", LONG_RUN),
        "launch": ("launch", "-c", config, "--name", "dry", "--dry-run", "data.path=data"),
        "status": ("status", LONG_RUN),
        "stop": ("stop", LONG_RUN, "--dry-run"),
        "resume": ("resume", STOPPED_RUN, "--dry-run"),
        "runs": ("runs",),
        "reindex": ("reindex",),
        "checkpoints": ("checkpoints", LONG_RUN, "--verify"),
        "plan": ("plan", "--model", "huginn-3.5b"),
        "slurm": ("slurm", "-c", config, "--name", "dry", "data.path=data"),
    }
    parsed = {}
    for command, args in outputs.items():
        result = invoke("-i", inventory, *args, "--json")
        assert result.exit_code in (0, 1), (command, result.output)
        parsed[command] = json.loads(result.stdout)
        no_numbers_as_strings(parsed[command], command)
    # Streaming commands: one JSON object per line.
    logs = invoke("-i", inventory, "logs", LONG_RUN, "--json").stdout.splitlines()
    assert [json.loads(line) for line in logs] == [{"host": "localhost", "line": "step 1 ..."}]
    watched = invoke("-i", inventory, "watch", LONG_RUN, "--json", "--poll", "0.1").stdout
    last = json.loads(watched.splitlines()[-1])
    assert last == {"run": LONG_RUN, "exit_code": 0, "state": "done"}
    # The numbers a script reads: accept's values with their units, sizes, ages, steps.
    criteria = {c["name"]: c for c in parsed["accept"]["criteria"]}
    tflops = criteria["TFLOPS per GPU"]
    assert (tflops["value"], tflops["unit"], tflops["limit"]) == (
        500.0,
        "TFLOP/s",
        pytest.approx(395.6, rel=0.01),
    )
    assert isinstance(criteria["checkpoints saved and verified"]["value"], int)
    assert all(c["value"] is None for c in criteria.values() if c["verdict"] == "NO DATA")
    assert isinstance(parsed["checkpoints"][0]["size_bytes"], int)
    assert (
        parsed["status"]["checkpoint"]["step"] == 200
        and parsed["inventory"]["hosts"][0]["port"] == 22
    )
    assert isinstance(parsed["health"]["hosts"][0]["duration"], float)
    assert parsed["slurm"]["script"].startswith("#!/bin/bash")
    assert parsed["reindex"] == {"indexed": []}
    assert "demo" in COMMANDS and all(
        "--json" in invoke(command, "--help", columns=200).output for command in COMMANDS
    )


def test_version_and_shell_completion() -> None:
    assert invoke("--version").output == f"rlmctl {version()}\n"
    completed = invoke(
        env={"_RLMCTL_COMPLETE": "complete_bash", "COMP_WORDS": "rlmctl che", "COMP_CWORD": "1"}
    )
    assert completed.output.split() == ["checkpoints"]
    # --show-completion names the shell it runs in from its parent processes, as in a user's bash.
    shown = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m rlmctl --show-completion; exit $?"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0 and "_RLMCTL_COMPLETE=complete_bash" in shown.stdout, shown


def test_help_has_no_hard_line_breaks_and_shows_the_global_options() -> None:
    """The commands' one-line summaries break only where the terminal ends (the docstrings'
    own line breaks once cut them: `PASS/FAIL/` then `NO DATA/N/A` on the next line)."""
    output = invoke("--help", columns=200).output
    rows = output[output.index("─ Commands ─") :].splitlines()[1:-1]
    first = rows[0]
    column = first.index(first.split()[2])  # where the help text starts ("│ inventory  Show")
    cell_end = first.rindex("│")
    width = cell_end - column
    for above, below in itertools.pairwise(rows):
        if below[2:column].strip():
            continue  # the next command's row
        text_above = above[column:cell_end].rstrip()
        next_word = below[column:cell_end].split()[0]
        assert len(text_above) + 1 + len(next_word) > width, (above, below)
    for command in COMMANDS:
        shown = invoke(command, "--help", columns=200).output
        assert GLOBAL_PANEL in shown and "--inventory" in shown and "--limit" in shown, command
    # stop's own --timeout (the SIGKILL grace) is not the global one
    stop_help = invoke("stop", "--help", columns=200).output
    assert stop_help.count("--timeout") == 1


def test_progress_bars_on_stderr(site: Path) -> None:
    interactive = {"TTY_INTERACTIVE": "1", "TTY_COMPATIBLE": "1"}  # as a terminal would be
    checked = invoke("-i", str(site), "checkpoints", LONG_RUN, "--verify", env=interactive)
    assert "sha256 of 2 checkpoint(s)" in checked.stderr
    health = invoke("-i", str(site), "health", env=interactive)
    assert "health checks on 1 host(s)" in health.stderr
    quiet = invoke("-i", str(site), "checkpoints", LONG_RUN, "--verify")
    assert quiet.stderr == ""  # not a terminal: no bar


def test_launch_dry_run_prints_what_launch_starts(tmp_path: Path) -> None:
    """The dry run's command line is the launcher's, argument for argument (but the fresh
    rendezvous id), and the dry run wrote nothing."""
    (tmp_path / "shared").mkdir()
    inventory = str(write_inventory(tmp_path, venv="/nonexistent-training-venv"))
    config = str(REPO / "trainer/configs/tiny.yaml")
    args = ("-i", inventory, "launch", "-c", config, "--name", "same", "train.steps=7")
    planned = json.loads(invoke(*args, "--dry-run", "--json").stdout)
    assert not (tmp_path / "shared" / "runs").exists()
    line = planned["commands"]["localhost"]
    assert "-m torch.distributed.run --nnodes=1 --nproc-per-node=2" in line
    # A launch whose hosts have no training python: the launcher starts, the trainer cannot.
    launched = rlmctl(*args, "--force")
    assert launched.returncode == 0, launched.stderr
    record = json.loads((tmp_path / "shared/runs/same/hosts/localhost/launch.json").read_text())
    started = " ".join(record["argv"])
    rendezvous = re.compile(r"--rdzv-id=\S+")
    assert rendezvous.sub("", started) in rendezvous.sub("", line)


@pytest.mark.integration
def test_rlmctl_slurm_prints_the_script_launch_submits(open_tmp_path: Path) -> None:
    """`rlmctl slurm` and `rlmctl launch` under rlm_scheduler: slurm render one script: the file
    launch writes and submits is byte for byte what `rlmctl slurm` printed for the same options.
    Slurm is a stand-in `sbatch` here (the real one: tests/slurm), run as the submitter."""
    tmp_path = open_tmp_path
    (tmp_path / "shared").mkdir()
    path = write_inventory(tmp_path, scheduler="slurm")
    path.write_text(path.read_text() + f"    rlm_service_user: {SUBMITTER}\n")
    inventory = str(path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --test-only ]; then cat >/dev/null; '
        'echo "sbatch: Job 4242 to start at 2026-12-02T21:30:00" >&2; exit 0; fi\n'
        f'cp "$2" {tmp_path}/submitted.sh\necho 4242\n'
    )
    sbatch.chmod(0o755)
    config = str(REPO / "trainer/configs/tiny.yaml")
    options = ("-c", config, "--name", "sl", "--time", "2:00:00", "train.steps=9")
    printed = rlmctl("-i", inventory, "slurm", *options)
    assert printed.returncode == 0, printed.stderr
    env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"}
    launched = rlmctl("-i", inventory, "launch", *options, env=env)
    assert launched.returncode == 0, launched.stderr
    assert "submitted sl as Slurm job 4242" in launched.stdout
    written = (tmp_path / "shared/runs/sl/slurm-launch-1.sh").read_text()
    assert written == printed.stdout == (tmp_path / "submitted.sh").read_text()
    assert f"'--config', '{tmp_path}/shared/runs/sl/config.yaml'" in written  # launch's copy


def test_stop_and_resume_dry_runs_change_nothing(site: Path) -> None:
    runs = site.parent / "shared" / "runs"
    events = (runs / STOPPED_RUN / "events.jsonl").read_bytes()
    planned = invoke("-i", str(site), "resume", STOPPED_RUN, "--dry-run")
    assert planned.exit_code == 0, planned.output
    assert planned.stdout.startswith("localhost: cd ")
    assert "checkpoint.resume=" in planned.stdout and "--nnodes=1" in planned.stdout
    stop = invoke("-i", str(site), "stop", LONG_RUN, "--dry-run")
    assert stop.exit_code == 0 and "already done; nothing to stop" in stop.stderr
    assert (runs / STOPPED_RUN / "events.jsonl").read_bytes() == events

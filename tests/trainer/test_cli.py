"""The command line as an operator meets it: subprocesses, exit codes and one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.training_runs import REPO, TINY, cli_env, overrides, run_cli
from trainer.rundir import ExitCode, RunDir, write_manifest


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and text in lines[0], lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.integration
@pytest.mark.parametrize(
    ("extra", "code", "text"),
    [
        (["train.stpes=3"], ExitCode.BAD_CONFIG, "did you mean 'train.steps'"),
        (["model.vocab_size=1000"], ExitCode.DATA_ERROR, "set model.vocab_size=4096"),
    ],
)
def test_bad_input_is_one_line_and_an_exit_code(
    prepared_data: Path, tmp_path: Path, extra: list[str], code: int, text: str
) -> None:
    run_dir = tmp_path / "run"
    result = run_cli("train", "--config", str(TINY), *overrides(prepared_data, run_dir, *extra))
    assert_one_line_error(result, code, text)
    assert not run_dir.exists()  # rejected before any work started


@pytest.mark.integration
def test_missing_data_is_a_data_error(tmp_path: Path) -> None:
    result = run_cli(
        "train", "--config", str(TINY), *overrides(tmp_path / "absent", tmp_path / "run")
    )
    assert_one_line_error(result, ExitCode.DATA_ERROR, "does not exist")


@pytest.mark.integration
def test_checkpoints_table_is_torch_free(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").create()
    good = run.checkpoint_path(10)
    good.mkdir()
    (good / "model.pt").write_bytes(b"x" * 1000)
    write_manifest(good, 10)
    run.checkpoint_path(20).mkdir()  # no manifest: an interrupted save
    probe = (
        "import sys\n"
        "from trainer.cli import main\n"
        f"sys.argv = ['rlm-train', 'checkpoints', {str(run.path)!r}, '--verify', 'full']\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
        "print('torch loaded:', 'torch' in sys.modules, 'exit:', code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=cli_env(), capture_output=True, text=True
    )
    lines = result.stdout.splitlines()
    assert lines[-1] == "torch loaded: False exit: 0", result.stdout + result.stderr
    assert any(line.split()[:2] == ["10", "yes"] for line in lines)
    assert any(line.split()[:2] == ["20", "NO"] and "partial" in line for line in lines)


@pytest.mark.integration
def test_console_script_and_usage_errors() -> None:
    script = Path(sys.executable).with_name("rlm-train")
    result = subprocess.run(
        [str(script), "--help"], env=cli_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    for command in ("prepare", "train", "checkpoints", "export", "generate"):
        assert command in result.stdout
    usage = run_cli("train")  # --config is required
    assert usage.returncode == ExitCode.BAD_CONFIG
    assert "Traceback" not in usage.stderr

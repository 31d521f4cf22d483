"""The production matrix on CPU: precision x strategy x activation checkpointing x compile x
checkpoint format x sync/async save, pairwise (tests/trainer/production_matrix.py says which cells
and why), each a real 2-rank gloo training with a resume in the middle.

Every cell must

- end both of its runs with exit 0, state done, its checkpoints in its format;
- resume exactly: step 3 trained again after the resume from step 2 has the loss and gradient
  norm of step 3 before it, bit for bit (same process, same kernels: anything restored wrongly,
  weights, AdamW moments, scheduler, loss scale, data position, shows here);
- agree with the uninterrupted fp32/DDP reference at every step within its precision's tolerance
  (below: measured deviation x ~5; one step changes the loss by 0.04-0.12, i.e. 0.5-1.4 %);
- compute RoPE in fp32: `apply_rope` refuses narrower tables (tests/trainer/test_model.py), so a
  cell that trains at all had fp32 tables under its strategy, compiled or not.

One torchrun job trains all cells in one process group (~3.5 min on 2 loaded cores, 2/3 of it
compiling the 3 compiled cells).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.production_matrix import CELLS, Cell
from tests.trainer.training_runs import REPO, TINY, cli_env
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.rundir import RunDir

# Relative deviation from the fp32/DDP reference loss, measured (2026-12-02): fp32 cells <= 6e-8
# (compiled and sharded: reduction order), fp16 <= 1e-5, bf16 <= 1e-4.
TOLERANCE = {"fp32": 1e-6, "fp16": 1e-4, "bf16": 5e-4}


@pytest.fixture(scope="module")
def matrix(prepared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("matrix")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", "-m", "tests.trainer.production_matrix"]
    result = subprocess.run(
        [*command, str(prepared_data), str(out)],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results["_job"] = {"returncode": result.returncode, "stderr": result.stderr[-4000:]}
    return out, results


def train_records(run: RunDir) -> list[dict]:
    return [r for r in run.read_metrics() if r["kind"] == "train"]


def verdict(results: dict, name: str) -> dict:
    if name not in results:
        pytest.fail(f"{name} did not run (the job ended before it):\n{results['_job']['stderr']}")
    cell = results[name]
    assert "error" not in cell, cell["error"]
    return cell


@pytest.mark.integration
def test_reference_trains(matrix: tuple[Path, dict]) -> None:
    out, results = matrix
    assert verdict(results, "reference")["exit_codes"] == [0]
    losses = [r["loss"] for r in train_records(RunDir(out / "reference"))]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.1, losses  # it learns: a cell's step moves the loss


@pytest.mark.integration
@pytest.mark.parametrize("cell", CELLS, ids=[cell.name for cell in CELLS])
def test_cell_trains_resumes_exactly_and_agrees_with_fp32_ddp(
    matrix: tuple[Path, dict], cell: Cell
) -> None:
    out, results = matrix
    found = verdict(results, cell.name)
    assert found["exit_codes"] == [0, 0], found
    run = RunDir(out / cell.name)
    records = train_records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 3, 4]
    before, after = records[2], records[3]
    assert (after["loss"], after["grad_norm"]) == (before["loss"], before["grad_norm"])
    reference = {r["step"]: r["loss"] for r in train_records(RunDir(out / "reference"))}
    for record in records:
        loss = record["loss"]
        assert isinstance(loss, float) and math.isfinite(loss), record
        deviation = abs(loss - reference[record["step"]]) / reference[record["step"]]
        assert deviation <= TOLERANCE[cell.precision], (record["step"], loss, deviation)
    if cell.precision == "fp16":  # the loss scaler ran (and skipped no step here)
        assert all(r["loss_scale"] for r in records), records

    starts = [e for e in run.events() if e.kind == "start"]
    assert starts[-1].fields["resumed_from"].endswith("step-00000002")
    assert run.status().state.value == "done" and run.status().exit_code == 0
    newest = run.checkpoint_path(4)
    on_disk = "sharded" if (newest / "dcp").is_dir() else "full"
    assert on_disk == cell.format
    assert [c.step for c in run.checkpoints() if c.valid] == [2, 3, 4]


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_fp16_with_sharding_is_refused_at_config_time(tmp_path: Path, strategy: str) -> None:
    """The one combination of the matrix that cannot work: refused by the config parser (so by
    `rlmctl launch` too), in one line, before any process group exists."""
    args = [f"run_dir={tmp_path}", "data.path=x", "train.precision=fp16"]
    with pytest.raises(
        ConfigError, match=f"fp16 is not supported with parallel.strategy={strategy}"
    ) as info:
        load_config(TINY, [*args, f"parallel.strategy={strategy}"])
    assert "\n" not in str(info.value)

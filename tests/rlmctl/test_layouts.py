"""`rlmctl plan`: memory per GPU of ddp / hsdp / fsdp / offload and the cheapest layout that fits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlmctl import plan, render
from rlmctl.records import MemoryEstimate, Plan


def no_checkpointing(**kwargs: object) -> MemoryEstimate:
    return plan.estimate("huginn-3.5b", None, 64.0, None, 1, **kwargs).estimates[0]


def test_huginn_on_mi250x_gcds_needs_sharding_and_prefers_hsdp_across_nodes() -> None:
    row = no_checkpointing(gpus=16, gpus_per_node=8)
    sizes = row.layouts.per_gpu_gib
    assert sizes["ddp"] > 64  # the reported failure: DDP cannot hold 3.5B + AdamW on 64 GB
    assert sizes["ddp"] > sizes["hsdp"] > sizes["fsdp"] > sizes["offload"]
    assert row.layouts.pick == "hsdp"  # fits, and keeps the all-gathers inside a node


def test_one_node_picks_fsdp_and_a_small_model_ddp() -> None:
    assert no_checkpointing(gpus=8, gpus_per_node=8).layouts.pick == "fsdp"
    small = plan.estimate("1b", None, 80.0, None, 1, gpus=8, gpus_per_node=8)
    assert small.estimates[0].layouts.pick == "ddp"


def test_plan_is_a_typed_record_and_its_json_keeps_the_fields() -> None:
    record = plan.estimate("1b", None, 80.0, None, 1)
    assert isinstance(record, Plan) and isinstance(record.estimates[0], MemoryEstimate)
    result = subprocess.run(
        [sys.executable, "-m", "rlmctl", "plan", "--model", "1b", "--json"],
        capture_output=True,
        text=True,
    )
    data = json.loads(result.stdout)
    assert data["params"] == record.params
    assert data["estimates"][0]["layouts"] == {
        "per_gpu_gib": record.estimates[0].layouts.per_gpu_gib,
        "pick": record.estimates[0].layouts.pick,
    }


def test_nothing_fits_says_so() -> None:
    tiny_gpu = plan.estimate("huginn-3.5b", None, 8.0, None, 8, gpus=2, gpus_per_node=2)
    assert tiny_gpu.estimates[0].layouts.pick is None
    assert "none fits" in "\n".join(render.plan_lines(tiny_gpu))


@pytest.mark.parametrize("gpus", ["0", "-1"])
def test_bad_gpu_count_is_one_line(gpus: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlmctl", "plan", "--model", "1b", "--gpus", gpus],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "--gpus and --gpus-per-node must be >= 1" in result.stderr


def test_plan_json_has_the_layouts() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlmctl", "plan", "--params", "3.5e9", "--gpus", "16", "--json"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    estimate = json.loads(result.stdout)
    assert estimate["estimates"][1]["layouts"]["pick"] in ("ddp", "hsdp", "fsdp", "offload")

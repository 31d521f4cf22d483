"""Config: YAML + key=value overrides into typed dataclasses, and rejection of bad input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.trainer.training_runs import REPO, TINY
from trainer.config import (
    check_world_size,
    dump_yaml,
    from_dict,
    load_config,
    to_dict,
    valid_keys,
)
from trainer.errors import ConfigError
from trainer.optim import lr_factor


def test_overrides_are_coerced_to_field_types() -> None:
    cfg = load_config(
        TINY,
        [
            "train.steps=7",
            "optim.lr=1e-3",
            "eval.depths=1,2,3",
            "optim.betas=[0.8, 0.9]",
            "model.d_model=128",
            "model.activation_checkpointing=true",
            "comm.compression=BF16",
            "run_dir=/tmp/x",
        ],
    )
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.optim.lr == 1e-3
    assert cfg.eval.depths == (1, 2, 3)
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.model.d_model == 128 and cfg.model.n_heads == 4  # the rest of the preset stays
    assert cfg.model.activation_checkpointing is True
    assert cfg.comm.compression == "bf16"
    assert cfg.run_dir == "/tmp/x"


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(TINY, ["model.preset=small", "train.steps=3"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(cfg))
    again = load_config(path)
    assert again == cfg
    assert from_dict(to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("train.stpes=3", "train.steps"),
        ("trian.steps=3", "train.steps"),
        ("model.d_modle=64", "model.d_model"),
        ("optim.warmup=10", "optim.warmup_steps"),
        ("checkpoint.interval=5", "checkpoint.interval_steps"),
    ],
)
def test_unknown_key_names_the_closest_valid_one(override: str, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"did you mean '{suggestion}'")) as info:
        load_config(TINY, [override])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lr=-0.1", "optim.lr must be > 0"),
        ("model.n_heads=3", "must divide model.d_model"),
        ("train.steps=ten", "train.steps must be int"),
        ("train.precision=fp8", "train.precision must be one of bf16, fp16, fp32"),
        ("train.global_batch=10", "multiple of train.micro_batch"),
        ("model.preset=tinny", "did you mean 'tiny'"),
        ("metrics.port=70000", "metrics.port"),
        ("eval.depths=0,4", "eval.depths"),
        ("steps", "must look like key=value"),
        ("optim.lr=inf", "optim.lr must be float"),
        ("eval.depths=[1,", "cannot read"),
    ],
)
def test_invalid_values_are_rejected(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(TINY, [override])


def test_global_batch_must_split_over_the_world() -> None:
    cfg = load_config(TINY, ["train.global_batch=8", "train.micro_batch=4"])
    assert check_world_size(cfg, 1) == 2
    assert check_world_size(cfg, 2) == 1
    with pytest.raises(ConfigError, match="not divisible by world size 4"):
        check_world_size(cfg, 4)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_shipped_configs_load() -> None:
    for path in sorted((REPO / "trainer" / "configs").glob("*.yaml")):
        load_config(path)


def test_every_key_is_documented() -> None:
    doc = (REPO / "docs" / "trainer.md").read_text()
    missing = [key for key in valid_keys() if f"`{key}`" not in doc]
    assert not missing, f"keys missing from docs/trainer.md: {missing}"


def test_lr_schedules() -> None:
    cfg = load_config(TINY, ["optim.warmup_steps=10", "optim.min_lr_ratio=0.1"]).optim
    assert lr_factor(0, 100, cfg) == pytest.approx(0.1)
    assert lr_factor(9, 100, cfg) == pytest.approx(1.0)
    assert lr_factor(10, 100, cfg) == pytest.approx(1.0)
    assert lr_factor(55, 100, cfg) == pytest.approx(0.55)  # cosine half-way to the floor
    assert lr_factor(100, 100, cfg) == pytest.approx(0.1)
    wsd = load_config(
        TINY, ["optim.schedule=wsd", "optim.warmup_steps=10", "optim.cooldown_fraction=0.2"]
    ).optim
    assert lr_factor(50, 100, wsd) == 1.0
    assert lr_factor(79, 100, wsd) == 1.0
    assert lr_factor(99, 100, wsd) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "override", ["train.debug_nan_steps=2", "train.ledger=true", "comm.debug_stall_rank=1"]
)
def test_fault_injection_is_not_configuration(override: str) -> None:
    # Test-only fault injection lives in tests/trainer/faults.py, behind trainer/hooks.py.
    with pytest.raises(ConfigError, match="unknown") as info:
        load_config(TINY, [override])
    assert "\n" not in str(info.value)


# GPU memory of the kinds inventory/example names (group comments): an MI250X GCD (the compute_amd
# group allows MI250X or MI300X; the smaller one), an H100 SXM.
EXAMPLE_GPU_GIB = {"compute_amd": 64.0, "compute_nvidia": 80.0}


def test_the_shipped_3_5b_config_uses_the_layout_the_plan_picks_for_the_example_inventory() -> None:
    """It was DDP with full checkpoints, which does not fit a 64 GB MI250X GCD (`rlmctl plan`
    knew). Now: the plan's pick for the smallest GPU of the example inventory, fitting all."""
    from rlmctl import plan

    cfg = load_config(REPO / "trainer" / "configs" / "huginn-3.5b.yaml")
    example = REPO / "inventory" / "example"
    hosts = yaml.safe_load((example / "hosts.yml").read_text())["all"]["children"]
    compute = hosts["compute"]["children"]
    for group, gpu_gib in EXAMPLE_GPU_GIB.items():
        per_node = yaml.safe_load((example / "group_vars" / f"{group}.yml").read_text())[
            "rlm_gpus_per_node"
        ]
        gpus = len(compute[group]["hosts"]) * per_node
        estimate = plan.estimate(
            cfg.preset, None, gpu_gib, cfg.model.max_seq_len, cfg.train.micro_batch, gpus, per_node
        )
        (row,) = [
            e
            for e in estimate.estimates
            if e.activation_checkpointing == cfg.model.activation_checkpointing
        ]
        needed = row.layouts.per_gpu_gib[cfg.parallel.strategy]
        assert needed <= estimate.usable_gib, (group, needed, estimate.usable_gib)
        if gpu_gib == min(EXAMPLE_GPU_GIB.values()):
            assert row.layouts.pick == cfg.parallel.strategy, (group, row.layouts)
    assert cfg.checkpoint.format == "sharded" and cfg.checkpoint.async_save

"""`rlmctl launch` checks a config's memory estimate (rlmctl plan) against the GPUs' memory
(rlm_gpu_memory_gib), over SSH and under Slurm: a config that cannot fit is one line naming the
layout that would, before any host is contacted or anything written; --no-memory-check insists.

Reproduces issue 21's report: the shipped huginn-3.5b.yaml (DDP) did not fit a 64 GB MI250X GCD,
which `rlmctl plan` knew and `rlmctl launch` did not check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlmctl import plan
from runcontract.config import load_config
from tests.rlmctl.conftest import assert_one_line_error, rlmctl

# The published Huginn-3.5B with activation checkpointing, one sequence per GPU, as DDP.
HUGINN_DDP = """\
model: {preset: huginn-3.5b, activation_checkpointing: true}
data: {path: data/pretrain-4096}
train: {steps: 10, global_batch: 64, micro_batch: 1, precision: bf16}
parallel: {strategy: ddp}
"""


def gpu_inventory(tmp_path: Path, scheduler: str) -> Path:
    """One node of 8 GPUs of 64 GiB (an MI250X's GCDs) whose SSH port is closed: nothing is
    ever started there."""
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    (inventory / "hosts.yml").write_text(
        "all:\n  children:\n    compute:\n      hosts:\n        gpu01:\n"
        "          ansible_host: 127.0.0.1\n          ansible_port: 9\n"
        "  vars:\n    rlm_gpu_vendor: amd\n"
        "    rlm_gpus_per_node: 8\n    rlm_gpu_memory_gib: 64\n"
        f'    rlm_shared_dir: "{{{{ inventory_dir }}}}/../shared"\n'
        f"    rlm_scheduler: {scheduler}\n",
        encoding="utf-8",
    )
    return inventory


@pytest.mark.parametrize("scheduler", ["ssh", "slurm"])
def test_a_config_that_cannot_fit_is_refused_with_the_layout_that_would(
    tmp_path: Path, scheduler: str
) -> None:
    config = tmp_path / "huginn-ddp.yaml"
    config.write_text(HUGINN_DDP, encoding="utf-8")
    inventory = gpu_inventory(tmp_path, scheduler)
    launch = ["-i", str(inventory), "launch", "--config", str(config), "--name", "big"]
    result = rlmctl(*launch)
    assert_one_line_error(
        result,
        2,
        "parallel.strategy=ddp",
        "57.0 GiB per GPU",
        "55.6 GiB usable of 64 GiB (rlm_gpu_memory_gib)",
        "parallel.strategy=fsdp fits (15.7 GiB per GPU on 8)",
        "--no-memory-check",
    )
    assert not (tmp_path / "shared" / "runs").exists()
    # Insisting gets past the estimate to the next check: the health gate (the host does not
    # answer), or the Slurm controller this inventory does not have.
    insisted = rlmctl("--timeout", "5", *launch, "--no-memory-check")
    if scheduler == "ssh":
        assert insisted.returncode == 1, insisted.stderr
        assert "health gate failed on 1 host(s): gpu01" in insisted.stderr
    else:
        assert_one_line_error(insisted, 2, "no 'mgmt' group")
    assert "memory estimate" not in insisted.stderr
    assert not (tmp_path / "shared" / "runs" / "big").exists()


def test_the_layout_the_refusal_names_fits(tmp_path: Path) -> None:
    config = tmp_path / "huginn-ddp.yaml"
    config.write_text(HUGINN_DDP, encoding="utf-8")
    ddp = load_config(config, ["run_dir=x"])
    refused = plan.config_fit(ddp, 8, 8, 64)
    assert refused.layout == "ddp" and refused.problem is not None
    fsdp = load_config(config, ["run_dir=x", "parallel.strategy=fsdp"])
    fits = plan.config_fit(fsdp, 8, 8, 64)
    assert fits.layout == "fsdp" and fits.problem is None
    # The same numbers as `rlmctl plan --model huginn-3.5b --gpu-mem 64` (with checkpointing).
    layouts = plan.estimate("huginn-3.5b", None, 64, None, 1).estimates[1].layouts
    assert round(refused.per_gpu_gib, 1) == round(layouts.per_gpu_gib["ddp"], 1)
    assert round(fits.per_gpu_gib, 1) == round(layouts.per_gpu_gib["fsdp"], 1)
    # The same activation checkpointing first (here: off, offloading fits) ...
    plain = load_config(config, ["run_dir=x", "model.activation_checkpointing=false"])
    problem = plan.config_fit(plain, 2, 8, 64).problem or ""
    assert problem.endswith(
        "parallel.strategy=fsdp parallel.offload=true fits (41.6 GiB per GPU on 2)"
    )
    # ... then with it on, when nothing fits without (two sequences' activations).
    wide = load_config(
        config, ["run_dir=x", "model.activation_checkpointing=false", "train.micro_batch=2"]
    )
    problem = plan.config_fit(wide, 2, 8, 64).problem or ""
    assert "parallel.strategy=fsdp model.activation_checkpointing=true fits" in problem, problem


@pytest.mark.parametrize(
    ("vendor", "memory"), [("none", "1"), ("amd", None)], ids=["cpu-host", "no-memory-fact"]
)
def test_hosts_without_the_gpu_memory_fact_are_not_judged(
    tmp_path: Path, vendor: str, memory: str | None
) -> None:
    """CPU hosts and hosts without rlm_gpu_memory_gib launch as before: on to the gate."""
    config = tmp_path / "huginn-ddp.yaml"
    config.write_text(HUGINN_DDP, encoding="utf-8")
    inventory = gpu_inventory(tmp_path, "ssh")
    hosts = (inventory / "hosts.yml").read_text(encoding="utf-8")
    hosts = hosts.replace("rlm_gpu_vendor: amd", f"rlm_gpu_vendor: {vendor}")
    hosts = hosts.replace("rlm_gpu_memory_gib: 64", f"rlm_gpu_memory_gib: {memory or 'null'}")
    (inventory / "hosts.yml").write_text(hosts, encoding="utf-8")
    launch = ["--timeout", "5", "-i", str(inventory), "launch", "--config", str(config)]
    result = rlmctl(*launch, "--name", "unjudged")
    assert result.returncode == 1, result.stderr
    assert "health gate failed on 1 host(s): gpu01" in result.stderr
    assert "memory estimate" not in result.stderr


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("group", ["compute_amd", "compute_nvidia"])
def test_the_shipped_3_5b_config_fits_the_example_inventorys_gpus(group: str) -> None:
    """Issue 21: the shipped huginn-3.5b.yaml (then DDP, 57 GiB per GPU) did not fit a 64 GiB
    MI250X GCD. By the estimate `rlmctl launch` runs (plan.config_fit, the check_memory of
    rlmctl/lifecycle.py), on each GPU group of inventory/example with its own facts: one node
    and all of the group's nodes."""
    example = REPO / "inventory" / "example"
    facts = yaml.safe_load((example / "group_vars" / f"{group}.yml").read_text(encoding="utf-8"))
    hosts = yaml.safe_load((example / "hosts.yml").read_text(encoding="utf-8"))
    nodes = len(hosts["all"]["children"]["compute"]["children"][group]["hosts"])
    per_node, memory = facts["rlm_gpus_per_node"], facts["rlm_gpu_memory_gib"]
    assert (per_node, memory) == {"compute_amd": (8, 64), "compute_nvidia": (8, 80)}[group]
    cfg = load_config(REPO / "trainer" / "configs" / "huginn-3.5b.yaml")
    for gpus in (per_node, nodes * per_node):
        fit = plan.config_fit(cfg, gpus, per_node, memory)
        assert fit.problem is None, (group, gpus, fit)
        assert fit.per_gpu_gib <= fit.usable_gib < memory
    # The config the file replaced (DDP, as shipped before) is refused on the 64 GiB GCDs.
    ddp = load_config(REPO / "trainer" / "configs" / "huginn-3.5b.yaml", ["parallel.strategy=ddp"])
    assert (plan.config_fit(ddp, nodes * per_node, per_node, memory).problem is None) == (
        memory >= 80
    )

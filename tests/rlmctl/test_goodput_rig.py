"""Stragglers and goodput on the rig: three hosts over real SSH, torchrun/gloo, one worker each;
node2's worker is slow (a hook that sleeps), node3's dies once (SIGKILL before a step). `rlmctl
watch --exclude-stragglers --checkpoint-interval auto` must restart without node2 (named with its
rank's figures), at the interval it measured, and the run must end done with its wall time
accounted. Reuses the session rig (tests/conftest.py `rig`): no nodes of its own.

Run as root with this helper's rig id: RLM_RIG_ID=9 .venv/bin/pytest tests/rlmctl/test_goodput_rig.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runcontract.goodput import goodput
from runcontract.rundir import RunDir
from runcontract.stragglers import RankWindows
from tests import goodput_faults
from tests.rlmctl.conftest import REPO, rlmctl

pytestmark = pytest.mark.rig

STEPS, KILL_AT = 80, 35  # between two saves (every 10 steps): the failure loses steps


def test_watch_leaves_out_a_straggler_and_applies_the_measured_interval(
    rig, tmp_path: Path
) -> None:
    goodput_faults.prepare_data(rig.shared_dir, REPO)
    goodput_faults.install(rig.shared_dir, REPO)
    inventory = goodput_faults.rig_inventory(
        rig.inventory_path,
        tmp_path / "inventory.yml",
        {
            "node2": goodput_faults.env(slow_here_s=0.15),
            # node3's worker is rank 0, 1 or 2 (the rendezvous decides): whichever it is
            "node3": goodput_faults.env(kill_step=KILL_AT, kill_here=True),
        },
    )
    inv = ["-i", str(inventory)]
    name = "straggler"
    overrides = ["data.path=data", f"train.steps={STEPS}", "train.global_batch=12"]
    overrides += ["train.micro_batch=2", "model.mean_recurrence=2", "train.precision=fp32"]
    overrides += ["eval.every=0", "metrics.log_every=5", "checkpoint.interval_steps=10"]
    config = str(REPO / "trainer/configs/tiny.yaml")
    result = rlmctl(*inv, "launch", "--config", config, "--name", name, *overrides, timeout=300)
    assert result.returncode == 0, result.stderr
    watch = rlmctl(
        *inv, "watch", name, "--poll", "1", "--backoff", "1", "--stall", "120",
        "--exclude-stragglers", "--checkpoint-interval", "auto",
        timeout=900,
    )  # fmt: skip
    assert watch.returncode == 0, watch.stderr
    run = RunDir(rig.shared_dir / "runs" / name)
    events = run.events()
    excluded = [e for e in events if e.kind == "excluded"]
    (straggler,) = [e for e in excluded if "straggler" in e.fields["reason"]]
    assert straggler.fields["hosts"] == ["node2"]
    (flagged,) = straggler.fields["stragglers"]
    assert flagged["host"] == "node2" and flagged["ratio"] > 1.2
    assert "excluding straggler host(s) node2" in watch.stderr
    starts = [e for e in events if e.kind == "start"]
    assert [s.fields["world_size"] for s in starts] == [3, 2]
    launch = json.loads((run.host_dir("node1") / "launch.json").read_text())
    assert "--nnodes=2" in launch["argv"]
    assert json.loads((run.host_dir("node2") / "launch.json").read_text())["kind"] == "launch"
    (choice,) = [e for e in events if e.kind == "checkpoint_interval"]
    assert f"checkpoint.interval_steps={choice.fields['steps']}" in launch["argv"]
    assert run.state().value == "done" and run.status().step == STEPS
    g = goodput(run)
    assert sum(g.parts.values()) == pytest.approx(g.wall_s, abs=1e-6)
    assert g.failures == 1 and g.steps_kept == STEPS and g.steps_lost > 0
    # the newest attempt's figures: two ranks, none of them on node2. Status reads those, not the
    # first attempt's where node2 stood out. With two ranks left on two busy cores either may
    # still be 1.2x the other (rank 0 did 1.42x once under a full `make test`), so status may
    # flag one of them: never node2.
    ranks = RankWindows.read(run)
    assert ranks is not None and sorted(ranks.hosts) == ["node1", "node3"]
    status = json.loads(rlmctl(*inv, "status", name, "--json").stdout)
    assert {s["host"] for s in status["goodput"]["stragglers"]} <= {"node1", "node3"}

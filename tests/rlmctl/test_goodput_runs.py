"""Goodput on real runs: the trainer launched by `rlmctl launch` on this machine (two CPU
workers, gloo), a worker killed by a fault hook, `rlmctl watch --checkpoint-interval auto`
restarting it; then the accounting, the interval chosen and applied, and what `status`,
`accept` and `plan` show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from runcontract.goodput import PARTS, account, goodput
from runcontract.rundir import RunDir
from tests import goodput_faults
from tests.ports import free_port
from tests.rlmctl.conftest import REPO, rlmctl

TINY = REPO / "trainer" / "configs" / "tiny.yaml"
STEPS, INTERVAL, KILL_AT = 60, 10, 25
FAST = [
    "model.mean_recurrence=2",
    "train.global_batch=8",
    "train.micro_batch=4",
    "train.precision=fp32",
    "eval.every=20",
    "eval.batches=1",
    "metrics.log_every=5",
    f"train.steps={STEPS}",
    f"checkpoint.interval_steps={INTERVAL}",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.data import prepare

    out = tmp_path_factory.mktemp("goodput-data") / "data"
    prepare(out, seq_len=64, vocab_size=4096)
    return out


def inventory_with_faults(tmp_path: Path, faults: dict[str, str]) -> Path:
    """This machine as a one-host cluster (two workers) whose trainers get `faults`."""
    shared = tmp_path / "shared"
    shared.mkdir()
    goodput_faults.install(shared, REPO)
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    host_vars = {
        "ansible_connection": "local",
        "rlm_gpu_vendor": "none",
        "rlm_gpus_per_node": 2,
        "rlm_shared_dir": str(shared),
        "rlm_rdzv_port": free_port(),
        "rlm_comm_env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **faults},
    }
    hosts = {"all": {"children": {"compute": {"hosts": {"localhost": None}}}, "vars": host_vars}}
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts), encoding="utf-8")
    return inventory


def train_records(run: RunDir) -> list[dict]:
    return [r for r in run.read_metrics() if r.get("kind") == "train"]


@pytest.mark.integration
def test_a_killed_worker_restarted_by_watch_is_accounted_and_sets_the_interval(
    tmp_path: Path, data: Path
) -> None:
    faults = goodput_faults.env(kill_step=KILL_AT, kill_on_rank=1)
    inventory = inventory_with_faults(tmp_path, faults)
    inv = ["-i", str(inventory)]
    result = rlmctl(
        *inv, "launch", "--config", str(TINY), "--name", "g", f"data.path={data}", *FAST,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    watch = rlmctl(
        *inv, "watch", "g", "--poll", "0.5", "--backoff", "1", "--stall", "120",
        "--checkpoint-interval", "auto",
        timeout=600,
    )  # fmt: skip
    assert watch.returncode == 0, watch.stderr
    assert "restart 1/3" in watch.stderr
    run = RunDir(tmp_path / "shared" / "runs" / "g")

    # The accounting: every second, the re-done steps exactly.
    g = goodput(run)
    assert sum(g.parts.values()) == pytest.approx(g.wall_s, abs=1e-6)
    assert set(g.parts) == set(PARTS)
    assert (g.attempts, g.failures, g.steps_kept, g.steps_lost) == (2, 1, STEPS, KILL_AT - 20)
    records = train_records(run)
    resumed = next(i for i, r in enumerate(records) if i and r["step"] <= records[i - 1]["step"])
    first_attempt = {r["step"]: r["time"] for r in records[:resumed]}
    assert max(first_attempt) == KILL_AT
    # Steps 21..25 of the first attempt were done again: their time is the lost work.
    assert g.parts["lost_work"] == pytest.approx(first_attempt[KILL_AT] - first_attempt[20])
    events = run.events()
    failure = next(e for e in events if e.kind == "failure")
    assert g.parts["detection"] == pytest.approx(failure.time - first_attempt[KILL_AT], abs=1e-6)
    relaunch = [e for e in events if e.kind == "launched"][1]
    assert g.parts["waiting"] == pytest.approx(relaunch.time - failure.time, abs=1e-6)
    assert g.parts["waiting"] >= 1.0  # the back-off
    assert g.parts["startup"] > 0 and g.parts["checkpoint_stall"] > 0
    assert g.parts["evaluation"] > 0  # eval.every=20: steps 20, 40, 60
    assert g.restart_cost_s == pytest.approx(
        g.parts["detection"] + g.parts["waiting"] + g.parts["startup"] - g.first_startup_s
    )

    # The interval: Young/Daly from this run's failure and measured stall, applied and kept.
    (choice,) = [e for e in events if e.kind == "checkpoint_interval"]
    steps = choice.fields["steps"]
    assert choice.fields["failures"] == 1 and choice.fields["previous"] == INTERVAL
    # The stall it used is the one measured when it chose (the first attempt's saves); the
    # second attempt's saves change the run's mean afterwards by however loaded the cores were.
    seen = account(
        run.name,
        [e for e in events if e.time <= choice.time],
        [r for r in run.read_metrics() if r["time"] <= choice.time],
        choice.time,
    )
    assert choice.fields["stall_s"] == pytest.approx(seen.checkpoint_stall_s, rel=1e-6)
    assert 1 <= steps <= 1000 and "Young/Daly" in choice.fields["reason"]
    assert f"checkpoint interval: {INTERVAL} -> {steps} steps" in watch.stderr
    launch = json.loads((run.host_dir("localhost") / "launch.json").read_text())
    assert f"checkpoint.interval_steps={steps}" in launch["argv"]
    assert run.status().checkpoint_interval_steps == steps
    saved = [e.fields["step"] for e in events if e.kind == "checkpoint" and e.time > relaunch.time]
    assert all(s % steps == 0 or s == STEPS for s in saved), saved

    # What the commands show.
    status = rlmctl(*inv, "status", "g", "--json")
    shown = json.loads(status.stdout)["goodput"]["goodput"]
    assert shown["steps_lost"] == KILL_AT - 20 and shown["failures"] == 1
    assert sum(shown["parts"].values()) == pytest.approx(shown["wall_s"])
    text = rlmctl(*inv, "status", "g").stdout
    assert f"goodput {100 * g.ratio:.1f}% of" in text and "lost work" in text
    verdict = json.loads(rlmctl(*inv, "accept", "g", "--json").stdout)
    criterion = next(c for c in verdict["criteria"] if c["name"] == "goodput")
    assert criterion["verdict"] == "NO DATA" and "shorter than" in criterion["reason"]
    assert verdict["goodput"]["steps_lost"] == KILL_AT - 20
    plan = rlmctl(*inv, "plan", "--nodes", "512", "--node-mtbf-hours", "50000", "--from-run", "g")
    assert plan.returncode == 0, plan.stderr
    assert "512 node(s) at a per-node MTBF of 50000 h" in plan.stdout
    assert "checkpoint.interval_steps=" in plan.stdout and "measured by run g" in plan.stdout


def test_plan_prints_the_interval_for_a_node_count_and_mtbf() -> None:
    result = rlmctl(
        "plan", "--nodes", "4096", "--node-mtbf-hours", "100000", "--checkpoint-stall", "10",
        "--step-time", "5", "--restart-cost", "600", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["job_mtbf_s"] == pytest.approx(100000 * 3600 / 4096)
    assert plan["optimum_s"] == pytest.approx((2 * 10 * plan["job_mtbf_s"]) ** 0.5)
    assert plan["choice"]["steps"] == round(plan["optimum_s"] / 5)
    assert 0.9 < plan["expected_goodput"] < 1
    missing = rlmctl("plan", "--nodes", "8", "--node-mtbf-hours", "1000")
    assert missing.returncode == 2 and "--checkpoint-stall" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_watch_refuses_an_unknown_checkpoint_interval() -> None:
    result = rlmctl("watch", "nothing", "--checkpoint-interval", "often")
    assert result.returncode == 2
    assert "--checkpoint-interval 'often' must be keep, auto or a number" in result.stderr
    assert "Traceback" not in result.stderr


def test_auto_takes_the_stall_from_a_run_of_the_same_model_before_its_own_first_save(
    tmp_path: Path,
) -> None:
    from rlmctl.goodput import auto_interval

    def make(name: str, preset: str, save: bool) -> RunDir:
        run = RunDir(tmp_path / name).create()
        run.config_path.write_text(
            yaml.safe_dump({"model": {"preset": preset}, "checkpoint": {"interval_steps": 100}})
        )
        with open(run.events_path, "a") as f:
            f.write('{"event": "launched", "hosts": ["a", "b"], "time": 1000.0}\n')
            f.write('{"event": "start", "step": 0, "time": 1001.0}\n')
        for step in range(1, 11):
            stall = 2.0 if save and step == 6 else 0.0
            record = {"kind": "train", "step": step, "step_time": 1.0, "checkpoint_stall": stall}
            run.append_metrics(
                {**record, "time": 1001.0 + step + (2.0 if step >= 6 and save else 0)}
            )
        with open(run.events_path, "a") as f:
            if save:
                f.write('{"event": "checkpoint", "step": 5, "seconds": 2.0, "time": 1008.0}\n')
            f.write('{"event": "failure", "exit_code": 137, "time": 1020.0}\n')
        return run

    failing = make("failing", "tiny", save=False)
    other_model = make("other", "small", save=True)
    same_model = make("same", "tiny", save=True)
    choice, seen = auto_interval(failing, [failing, other_model], 1000)
    assert choice.steps is None and "checkpoint stall" in choice.reason
    choice, seen = auto_interval(failing, [failing, other_model, same_model], 1000)
    assert seen.failures == 3  # this run's and the two others' in the registry
    assert choice.stall_s == pytest.approx(2.0) and choice.steps is not None

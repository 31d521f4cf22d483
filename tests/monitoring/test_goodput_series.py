"""rlm-exporter's goodput and straggler series (monitoring/goodput.py), scraped over HTTP from
the exporter as it runs, and its incremental reading of the run files."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from monitoring.goodput import GoodputReader
from runcontract.goodput import goodput
from runcontract.rundir import RunDir
from runcontract.stragglers import RankWindows
from tests.monitoring.conftest import scrape, value, wait_for


def write_run(root: Path, name: str, start: float, steps: int) -> RunDir:
    """A run that ended: launched, started 5 s later, `steps` steps of 1 s, done."""
    run = RunDir(root / name).create()
    with open(run.events_path, "a") as f:  # explicit times, written as the contract writes
        f.write(f'{{"event": "launched", "hosts": ["a"], "time": {start}}}\n')
        f.write(f'{{"event": "start", "step": 0, "time": {start + 5}}}\n')
    for step in range(1, steps + 1):
        run.append_metrics(
            {"kind": "train", "step": step, "time": start + 5 + step, "step_time": 1.0}
        )
    with open(run.events_path, "a") as f:
        f.write(
            f'{{"event": "exit", "exit_code": 0, "state": "done", "step": {steps}, '
            f'"time": {start + 5 + steps}}}\n'
        )
    run.write_status(state="done", step=steps, max_steps=steps)
    return run


def test_goodput_and_this_hosts_ranks_are_exported(tmp_path: Path, run_exporter) -> None:
    runs = tmp_path / "runs"
    run = write_run(runs, "g", time.time() - 100, 20)
    me = socket.gethostname()
    ranks = RankWindows(hosts=[me, me, "elsewhere", me], started=time.time())
    for step in (10, 20, 30):  # rank 1 is slow (own 2 s against 1 s) in every window
        ranks.add(step, 10, [[2.5, 0.1, 1.5], [2.5, 0.2, 0.5], [2.5, 0.1, 1.5], [2.5, 0.1, 1.5]])
    ranks.write(run)
    port = run_exporter("--run-root", str(runs), "--interval", "0.5", "--gpu-source", "none")
    samples = wait_for(
        lambda: (s := scrape(port)) and value(s, "rlm_run_goodput_ratio", run="g") and s,
        what="the goodput series",
    )
    assert value(samples, "rlm_run_goodput_ratio", run="g") == pytest.approx(20 / 25)
    assert value(samples, "rlm_run_wall_seconds", run="g") == pytest.approx(25.0)
    assert value(samples, "rlm_run_time_seconds", run="g", part="startup") == pytest.approx(5.0)
    assert value(samples, "rlm_run_time_seconds", run="g", part="lost_work") == 0.0
    assert value(samples, "rlm_run_stragglers", run="g") == 1
    slow = {"run": "g", "rank": "1", "rank_host": me}
    assert value(samples, "rlm_rank_straggler", **slow) == 1
    assert value(samples, "rlm_rank_own_seconds", **slow) == pytest.approx(2.0)
    assert value(samples, "rlm_rank_collective_wait_seconds", **slow) == pytest.approx(0.5)
    assert value(samples, "rlm_rank_slowness_ratio", **slow) == pytest.approx(2.0)
    assert value(samples, "rlm_rank_straggler", run="g", rank="0", rank_host=me) == 0
    # another host's rank is that host's exporter's to export
    assert value(samples, "rlm_rank_straggler", run="g", rank="2", rank_host="elsewhere") is None


def test_the_reader_reads_what_was_appended_and_starts_again_on_a_new_file(tmp_path: Path) -> None:
    start = time.time() - 1000
    run = write_run(tmp_path, "r", start, 10)
    reader = GoodputReader(settle_s=30)
    first = reader.read(run.path)
    assert first is not None and first["steps_kept"] == 10
    # A resume of the ended run: its new lines are read from where the reader stopped.
    with open(run.events_path, "a") as f:
        f.write(f'{{"event": "launched", "hosts": ["a"], "time": {start + 100}}}\n')
        f.write(f'{{"event": "start", "step": 10, "time": {start + 102}}}\n')
    for step in range(11, 16):
        run.append_metrics(
            {"kind": "train", "step": step, "time": start + 102 + step - 10, "step_time": 1.0}
        )
    with open(run.events_path, "a") as f:
        f.write(f'{{"event": "exit", "exit_code": 0, "state": "done", "time": {start + 108}}}\n')
    second = reader.read(run.path)
    assert second == goodput(run).to_dict()
    assert second["steps_kept"] == 15 and second["attempts"] == 2
    # The run directory replaced by a shorter one: the fold starts again.
    run.metrics_path.unlink()
    run.events_path.unlink()
    fresh = write_run(tmp_path, "r", start, 3)
    assert reader.read(fresh.path)["steps_kept"] == 3


def test_an_active_run_is_figured_as_of_the_settling_horizon(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "live").create()
    run.append_event("launched", hosts=["a"])
    run.append_event("start", step=0)
    base = run.events()[-1].time
    for step in range(1, 6):
        run.append_metrics({"kind": "train", "step": step, "time": base + step, "step_time": 1.0})
    reader = GoodputReader(settle_s=30)
    assert reader.read(run.path, now=base + 10) is None  # nothing has settled yet
    later = reader.read(run.path, now=base + 40)
    assert later["steps_kept"] == 5
    assert later["wall_s"] == pytest.approx(base + 10 - run.events()[0].time)


def test_the_dashboards_goodput_panels_show_series_the_exporter_writes() -> None:
    """Grafana's goodput and straggler panels, their recording rules expanded, name only series
    that monitoring.goodput exports (a renamed gauge leaves no panel silently empty)."""
    import json
    import re

    import yaml

    from monitoring.goodput import families

    monitoring = Path(__file__).resolve().parents[2] / "monitoring"
    dashboard = json.loads((monitoring / "grafana" / "dashboards" / "rlm.json").read_text())
    rules = yaml.safe_load((monitoring / "prometheus" / "rules" / "goodput.yml").read_text())
    recorded = {
        r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r
    }
    panels = {p["title"]: p for p in dashboard["panels"]}
    wanted = ("Goodput", "Where the wall time went", "Rank slowness (own time / peers' median)")
    assert all(title in panels for title in wanted)
    exprs = [t["expr"] for title in wanted for t in panels[title]["targets"]]
    used_rules = {name for e in exprs for name in re.findall(r"rlm:[a-z0-9_:]+", e)}
    assert used_rules and used_rules <= recorded.keys()
    exprs += [recorded[name] for name in used_rules]
    used = {name for e in exprs for name in re.findall(r"\brlm_[a-z0-9_]+", e)}
    exported = {family.name for family in families([])}
    assert {"rlm_run_goodput_ratio", "rlm_run_time_seconds", "rlm_rank_slowness_ratio"} <= used
    assert used <= exported, used - exported

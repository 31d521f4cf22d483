"""`rlmctl accept`: every criterion on synthetic run directories, once passing and once failing,
plus the bad inputs (no metrics yet, Prometheus not answering, unknown SKU, no health report)."""

from __future__ import annotations

import json
import math
import socket
import time
from pathlib import Path

import pytest

from rlmctl import accept
from runcontract.rundir import RunDir, checkpoint_dir_name, write_manifest
from tests.rlmctl.conftest import assert_one_line_error, rlmctl

LIMITS = accept.thresholds(None)


def make_run(
    tmp_path: Path,
    steps: int = 200,
    loss=lambda step, depth: 5.0 - step / 100 - 0.1 * depth,
    grad=lambda step: 1.0,
    lr=lambda step: 1e-3 * min(1.0, step / 50),
    tflops: float = 500.0,
    device: str = "cuda",
    peak_source: str = "datasheet H100 (NVIDIA H100 80GB HBM3)",
    seq_len: int = 2048,
    val: list[dict[str, float]] | None = None,
    checkpoints: tuple[int, ...] = (100, 200),
    nonfinite: int = 0,
) -> RunDir:
    run_dir = (
        RunDir(tmp_path).create()
        if tmp_path.parent.name == "runs"
        else RunDir(tmp_path / "run").create()
    )
    run_dir.append_event("launched")
    run_dir.append_event(
        "start", step=0, seq_len=seq_len, device=device, peak_source=peak_source, world_size=8
    )
    for step in range(1, steps + 1):
        depth = (step * 7) % 5 + 1  # the sampled recurrence jumps around
        run_dir.append_metrics(
            {
                "kind": "train",
                "step": step,
                "loss": loss(step, depth),
                "lr": lr(step),
                "grad_norm": grad(step),
                "tokens": step * 1000,
                "recurrence": depth,
                "tflops": tflops,
                "time": time.time(),
            }
        )
    for index, ppl in enumerate(val or [{"1": 40.0, "4": 30.0}, {"1": 20.0, "4": 15.0}]):
        run_dir.append_metrics({"kind": "val", "step": (index + 1) * 100, "perplexity": ppl})
    for _ in range(nonfinite):
        run_dir.append_event("nonfinite", step=5, loss="nan", grad_norm="nan")
    for step in checkpoints:
        path = run_dir.checkpoints_dir / checkpoint_dir_name(step)
        path.mkdir(parents=True)
        (path / "model.pt").write_bytes(b"x" * 64)
        write_manifest(path, step)
    log = run_dir.launcher_log_path("node1")
    log.parent.mkdir(parents=True)
    log.write_text("step 1 ...\n")
    run_dir.append_event("exit", exit_code=0, state="done", step=steps)
    return run_dir


def judge(run_dir: RunDir, criterion, **limits) -> accept.Criterion:
    return criterion(accept.RunData.load(run_dir), LIMITS | limits)


def test_tflops_per_gpu(tmp_path: Path) -> None:
    good = judge(make_run(tmp_path / "a"), accept.tflops_per_gpu)
    assert good.verdict == accept.PASS and "40% of H100 peak" in good.threshold
    slow = judge(make_run(tmp_path / "b", tflops=100.0), accept.tflops_per_gpu)
    assert slow.verdict == accept.FAIL
    mi250x = make_run(tmp_path / "c", tflops=110.0, peak_source="datasheet MI250X (AMD MI250X)")
    assert judge(mi250x, accept.tflops_per_gpu).threshold.startswith(">= 120 ")


def test_tflops_unknown_sku_and_cpu(tmp_path: Path) -> None:
    unknown = judge(make_run(tmp_path / "a", peak_source="NVIDIA L4"), accept.tflops_per_gpu)
    assert unknown.verdict == accept.NO_DATA and "unknown SKU (NVIDIA L4)" in unknown.reason
    cpu = make_run(tmp_path / "b", device="cpu", peak_source="measured GEMM probe on cpu")
    assert judge(cpu, accept.tflops_per_gpu).verdict == accept.NA
    # A CPU threshold from the inventory makes it judged again.
    assert judge(cpu, accept.tflops_per_gpu, tflops_per_gpu=1.0).verdict == accept.PASS


def test_loss_falling_is_robust_to_the_sampled_depth(tmp_path: Path) -> None:
    assert judge(make_run(tmp_path / "a"), accept.loss_falling).verdict == accept.PASS
    # A flat loss whose raw series still "falls" because deep samples cluster at the end.
    flat = make_run(tmp_path / "b", loss=lambda step, depth: 3.0 - 0.5 * depth + 0 * step)
    assert judge(flat, accept.loss_falling).verdict == accept.FAIL
    rising = make_run(tmp_path / "c", loss=lambda step, depth: 2.0 + step / 100)
    assert judge(rising, accept.loss_falling).verdict == accept.FAIL


def test_val_perplexity_falling_at_every_depth(tmp_path: Path) -> None:
    assert judge(make_run(tmp_path / "a"), accept.val_ppl_falling).verdict == accept.PASS
    stuck = make_run(tmp_path / "b", val=[{"1": 40.0, "4": 30.0}, {"1": 20.0, "4": 31.0}])
    result = judge(stuck, accept.val_ppl_falling)
    assert result.verdict == accept.FAIL and result.reason == "not falling at depth 4"


def test_perplexity_falling_with_depth(tmp_path: Path) -> None:
    assert judge(make_run(tmp_path / "a"), accept.ppl_falls_with_depth).verdict == accept.PASS
    worse = make_run(tmp_path / "b", val=[{"1": 20.0, "4": 25.0}])
    result = judge(worse, accept.ppl_falls_with_depth)
    assert result.verdict == accept.FAIL and "d1->d4" in result.reason


def test_grad_norm_stability(tmp_path: Path) -> None:
    assert judge(make_run(tmp_path / "a"), accept.grad_norm_stable).verdict == accept.PASS
    spiky = make_run(tmp_path / "b", grad=lambda step: 50.0 if step == 150 else 1.0)
    result = judge(spiky, accept.grad_norm_stable)
    assert result.verdict == accept.FAIL and "150" in result.reason
    short = make_run(tmp_path / "c", seq_len=256)
    assert judge(short, accept.grad_norm_stable).verdict == accept.NA


def test_lr_smoothness(tmp_path: Path) -> None:
    assert judge(make_run(tmp_path / "a"), accept.lr_smooth).verdict == accept.PASS
    jumpy = make_run(tmp_path / "b", lr=lambda step: 1e-3 if step < 120 else 1e-4)
    result = judge(jumpy, accept.lr_smooth)
    assert result.verdict == accept.FAIL and "step 120" in result.reason


def test_checkpoints_interval_and_verification(tmp_path: Path) -> None:
    assert judge(make_run(tmp_path / "a"), accept.checkpoints_ok).verdict == accept.PASS
    sparse = make_run(tmp_path / "b", checkpoints=(100, 200))
    result = judge(sparse, accept.checkpoints_ok, checkpoint_max_interval=50)
    assert result.verdict == accept.FAIL and "gap 100 > 50" in result.reason
    broken = make_run(tmp_path / "c")
    (broken.checkpoints_dir / checkpoint_dir_name(200) / "model.pt").write_bytes(b"x")
    result = judge(broken, accept.checkpoints_ok)
    assert result.verdict == accept.FAIL and "step-00000200: model.pt has 1 bytes" in result.reason


def test_logs_present_and_growing(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "a")
    assert judge(run_dir, accept.logs_present).verdict == accept.PASS
    run_dir.launcher_log_path("node1").write_text("")
    result = judge(run_dir, accept.logs_present)
    assert result.verdict == accept.FAIL and result.reason == "empty: node1"


def test_nonfinite_steps(tmp_path: Path) -> None:
    assert judge(make_run(tmp_path / "a"), accept.nonfinite_steps).verdict == accept.PASS
    result = judge(make_run(tmp_path / "b", nonfinite=2), accept.nonfinite_steps)
    assert result.verdict == accept.FAIL and result.measured == "2 steps"
    assert (result.value, result.unit, result.limit) == (2, "steps", 0)


def test_a_run_without_metrics_yet_is_no_data_never_a_traceback(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "fresh").create()
    verdict = accept.evaluate("fresh", run_dir, LIMITS, None, None, "nowhere")
    assert verdict.accepted  # nothing failed...
    assert set(verdict.not_checked) >= {"loss falling", "TFLOPS per GPU", "GPU utilisation"}
    reasons = {c.name: c.reason for c in verdict.criteria}
    assert reasons["GPU utilisation"] == "rlm_prometheus_url is not set"
    assert reasons["GPU topology"].startswith("no health report yet")
    path = accept.write_report(verdict, run_dir, [])
    assert "| loss falling |" in path.read_text()


def test_prometheus_not_answering_is_no_data_with_the_reason(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once closed
    url = f"http://127.0.0.1:{port}"
    criteria = accept.prometheus_criteria(url, "r", 600, LIMITS, cpu=False)
    assert {c.verdict for c in criteria} == {accept.NO_DATA}
    assert all("does not answer" in c.reason for c in criteria)


def test_health_report_topology_and_transport(tmp_path: Path) -> None:
    report = {
        "time": time.time(),
        "hosts": [
            {"host": "n1", "checks": [{"name": "topology", "state": "OK", "detail": "8 GPUs"}]},
            {
                "host": "n2",
                "checks": [{"name": "topology", "state": "CRIT", "detail": "GPU2-GPU5 SYS"}],
            },
        ],
        "deep": {
            "problems": ["n1: n1 <-> n2: channel 3 via NET/Socket/3, expected ib"],
            "comm_path": {"n1": {"summary": "NET/Socket x2"}},
        },
    }
    topo, comm = accept.health_criteria(report, "health-last.json")
    assert topo.verdict == accept.FAIL and "n2: GPU2-GPU5 SYS" in topo.reason
    assert comm.verdict == accept.FAIL and "NET/Socket/3" in comm.reason
    report["hosts"].pop()
    report["deep"] = {"problems": [], "comm_path": {"n1": {"summary": "NET/IB/GDRDMA x16"}}}
    topo, comm = accept.health_criteria(report, "health-last.json")
    assert topo.verdict == comm.verdict == accept.PASS


def test_report_with_plots(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path)
    verdict = accept.evaluate("r", run_dir, LIMITS, None, None, "nowhere")
    accept.write_report(verdict, run_dir, [])
    text = (run_dir.path / "acceptance.md").read_text()
    assert "**Verdict: ACCEPTED**" in text
    # PNG with matplotlib, SVG without (tests/rlmctl/test_charts.py looks at them)
    drawn = [Path(p) for p in verdict.plots]
    assert [p.stem for p in drawn] == ["loss", "val-perplexity", "perplexity-by-depth", "tflops"]
    for path in drawn:
        assert path.stat().st_size > 1000 and f"](acceptance/{path.name})" in text


def test_unknown_threshold_key_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown keys gpu_util"):
        accept.thresholds({"gpu_util": 90})


def test_verdict_json_is_serialisable(tmp_path: Path) -> None:
    verdict = accept.evaluate("r", make_run(tmp_path), LIMITS, None, None, "nowhere")
    data = json.loads(json.dumps(verdict.as_dict()))
    assert data["accepted"] and len(data["criteria"]) == 16
    assert not any(
        isinstance(c["measured"], float) and math.isnan(c["measured"]) for c in data["criteria"]
    )


def test_pruned_checkpoints_are_judged_by_the_kept_ones_and_the_config(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "a", steps=200, checkpoints=(150, 200))  # 50 and 100 pruned
    assert judge(run_dir, accept.checkpoints_ok, checkpoint_max_interval=60).verdict == accept.PASS
    run_dir.config_path.write_text("checkpoint: {interval_steps: 10000}\n")
    result = judge(run_dir, accept.checkpoints_ok)
    assert result.verdict == accept.FAIL and "gap 10000 > 5000" in result.reason


@pytest.mark.integration
def test_cli_accept_exit_codes_json_and_bad_input(local_inventory: Path) -> None:
    """The command as an operator runs it: a table or --json, exit 1 on a FAIL, one-line errors."""
    shared = local_inventory.parent / "shared"
    for name, nonfinite in (("good-run", 0), ("bad-run", 3)):
        run_dir = make_run(shared / "runs" / name, nonfinite=nonfinite)
        run_dir.config_path.write_text("checkpoint: {interval_steps: 100}\n")
    assert rlmctl("-i", str(local_inventory), "reindex").returncode == 0
    result = rlmctl("-i", str(local_inventory), "accept", "good-run", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["accepted"] and Path(data["report"]).name == "acceptance.md"
    assert "GPU topology" in data["not_checked"]  # no health report in this shared dir yet
    result = rlmctl("-i", str(local_inventory), "accept", "bad-run")
    assert (
        result.returncode == 1
        and "NOT ACCEPTED" in result.stdout
        and "Traceback" not in result.stderr
    )
    assert_one_line_error(rlmctl("-i", str(local_inventory), "accept", "nope"), 2, "nope")
    hosts = local_inventory / "hosts.yml"
    hosts.write_text(hosts.read_text() + "    rlm_accept_thresholds: {gpu_util: 90}\n")
    bad = rlmctl("-i", str(local_inventory), "accept", "good-run")
    assert_one_line_error(bad, 2, "rlm_accept_thresholds has unknown keys gpu_util")


def test_cpu_run_marks_gpu_criteria_not_applicable_even_without_prometheus() -> None:
    criteria = accept.prometheus_criteria(None, "r", 60, LIMITS, cpu=True)
    assert [c.verdict for c in criteria] == [accept.NA, accept.NA, accept.NO_DATA, accept.NO_DATA]
    assert criteria[0].reason == "CPU run: no GPU or RDMA link"


def test_cli_accept_on_a_binary_garbage_metrics_file_is_one_line(local_inventory: Path) -> None:
    """Reported: a metrics.jsonl of binary garbage gave a traceback. Now one line naming the
    file, exit 2, and nothing of the run directory touched."""
    shared = local_inventory.parent / "shared"
    run_dir = make_run(shared / "runs" / "garbage")
    run_dir.config_path.write_text("checkpoint: {interval_steps: 100}\n")
    garbage = bytes(range(256)) * 64 + b"\n\x00\xff\xfe{not json\n"
    run_dir.metrics_path.write_bytes(garbage)
    assert rlmctl("-i", str(local_inventory), "reindex").returncode == 0
    result = rlmctl("-i", str(local_inventory), "accept", "garbage")
    assert_one_line_error(result, 2, str(run_dir.metrics_path), "not JSON lines")
    assert run_dir.metrics_path.read_bytes() == garbage
    assert not (run_dir.path / "acceptance.md").exists()
    # A file of JSON values that are not records (a list per line) is refused the same way.
    run_dir.metrics_path.write_text("[1, 2]\n[3, 4]\n")
    result = rlmctl("-i", str(local_inventory), "accept", "garbage")
    assert_one_line_error(result, 2, str(run_dir.metrics_path), "line 1")


@pytest.mark.integration
def test_a_plain_health_run_keeps_the_deep_record(local_inventory: Path) -> None:
    """Reported: `rlmctl health` after `health --deep` replaced the one record accept reads, and
    the communication path became NO DATA. The deep record is kept apart."""
    from rlmctl import health

    shared = local_inventory.parent / "shared"
    run_dir = make_run(shared / "runs" / "kept")
    run_dir.config_path.write_text("checkpoint: {interval_steps: 100}\n")
    assert rlmctl("-i", str(local_inventory), "reindex").returncode == 0
    deep = {"ok": True, "problems": [], "comm_path": {"localhost": {"summary": "NET/IB x8"}}}
    health.save_last_report({"state": "OK", "hosts": [], "deep": deep}, str(shared))
    assert rlmctl("-i", str(local_inventory), "health").returncode in (0, 1)
    result = rlmctl("-i", str(local_inventory), "accept", "kept", "--json")
    criteria = {c["name"]: c for c in json.loads(result.stdout)["criteria"]}
    path = criteria["communication path"]
    assert path["verdict"] == accept.PASS and "NET/IB x8" in path["measured"], path
    assert criteria["GPU topology"]["verdict"] != accept.NO_DATA  # from the newer plain run

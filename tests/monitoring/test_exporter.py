"""rlm-exporter scraped over real HTTP: GPU tools on PATH, run directories, bad input."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from monitoring import exporter
from rlmctl import hostproc
from tests.monitoring.conftest import (
    install_tool,
    names,
    printing,
    printing_nvidia,
    scrape,
    value,
    wait_for,
)
from tests.monitoring.test_config import annotation_queries, dashboard_queries, rules
from trainer.rundir import RunDir, write_json_atomic, write_manifest

GPU_SERIES = "rlm_gpu_temperature_celsius"


def uuid(index: int) -> str:
    """The UUID the nvidia-smi stand-in gives GPU `index`."""
    return f"GPU-5b0e3c1a-9f1d-4c2b-8e7a-00000000000{index}"


def xids(samples) -> dict[tuple[str, str, str], float]:
    """(gpu, PCI bus, xid code) -> count of rlm_gpu_xid_errors_total."""
    return {
        (d.get("gpu", ""), d["pci_bus"].split(":")[1], d["xid"]): v
        for (n, labels), v in samples.items()
        if n == "rlm_gpu_xid_errors_total" and (d := dict(labels))
    }


def make_run(root: Path, name: str = "run-a", state: str = "running", step: int = 120) -> RunDir:
    run = RunDir(root / name).create()
    run.append_event("start")
    run.append_event("start")  # one restart
    run.append_event("checkpoint_failed", step=50, error="disk full")
    for checkpoint_step in (50, 100):
        path = run.checkpoint_path(checkpoint_step)
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"weights" * 10)
        write_manifest(path, checkpoint_step)
    broken = run.checkpoint_path(110)  # a save interrupted before its manifest
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"half")
    run.append_metrics({"step": step, "loss": 3.2, "lr": 3e-4})
    run.write_status(
        state=state,
        step=step,
        loss=3.2,
        checkpoint_interval_steps=50,
        max_steps=1000,
        step_time=0.8,
        comm_time=0.2,
    )
    return run


def test_scrape_reports_gpus_runs_processes_filesystem_and_network(
    tmp_path, tool_bin, run_exporter
) -> None:
    install_tool(tool_bin, "nvidia-smi", printing_nvidia("nvidia-smi-8gpu.csv"))
    install_tool(tool_bin, "dmesg", printing("dmesg-xid.txt"))
    runs = tmp_path / "runs"
    make_run(runs)
    make_run(runs, "run-done", state="done").append_event("exit", exit_code=0, state="done")
    make_run(runs, "run-garbled").status_path.write_text("{")
    (runs / "not-a-run").mkdir()
    run_a = ["--config", "c.yaml", f"run_dir={runs / 'run-a'}"]
    trainer = subprocess.Popen(  # looks like a trainer worker to the exporter; sleeps only
        [sys.executable, "-c", "import time; time.sleep(60)", "-m", "trainer", "train", *run_a]
    )
    try:
        port = run_exporter("--run-root", str(runs), "--interval", "2", "--expected-gpus", "8")
        samples = wait_for(
            lambda: (
                (s := scrape(port))
                and {"rlm_run_step", GPU_SERIES, "rlm_gpu_pcie_replays_total"} <= names(s)
                and s
            ),
            what="GPU, link counter and run series",
        )
        assert value(samples, "rlm_exporter_gpu_source_info", source="nvidia-smi") == 1
        assert value(samples, "rlm_exporter_source_up", source="nvidia-smi") == 1
        assert value(samples, GPU_SERIES, gpu="2", uuid=uuid(2)) == 66
        assert value(samples, "rlm_gpu_utilization_ratio", gpu="6", uuid=uuid(6)) == 0.97
        assert value(samples, "rlm_gpu_power_limit_watts", gpu="0", uuid=uuid(0)) == 700
        assert value(samples, "rlm_gpu_ecc_uncorrected_errors_total", gpu="7", uuid=uuid(7)) == 1
        gpu0 = {"gpu": "0", "uuid": uuid(0)}
        assert value(samples, "rlm_gpu_clock_event", **gpu0, reason="sw_power_cap") == 1
        assert value(samples, "rlm_gpu_clock_event", **gpu0, reason="hw_slowdown") == 0
        assert value(samples, "rlm_gpu_memory_temperature_celsius", **gpu0) == 70
        assert value(samples, "rlm_gpu_row_remap_pending", gpu="7", uuid=uuid(7)) == 1
        assert value(samples, "rlm_gpu_row_remap_failed", gpu="7", uuid=uuid(7)) == 0
        # nvidia-smi -q's replay counter by PCI address, nvlink -e's counters by UUID.
        assert value(samples, "rlm_gpu_pcie_replays_total", gpu="2", uuid=uuid(2)) == 12
        link5 = {"gpu": "2", "uuid": uuid(2), "link": "5"}
        assert (
            value(samples, "rlm_gpu_interconnect_errors_total", **link5, counter="crc_errors") == 37
        )
        assert value(samples, "rlm_exporter_source_up", source="gpu-counters") == 1
        assert xids(samples) == {("2", "3a", "79"): 1, ("7", "db", "48"): 1, ("7", "db", "63"): 1}
        assert value(samples, "rlm_gpus_seen") == 8
        assert value(samples, "rlm_gpus_expected") == 8
        assert value(samples, "rlm_gpu_present", gpu="3", uuid=uuid(3), pci_bus="0000:5d:00") == 1
        info = {dict(labels)["serial"] for n, labels in samples if n == "rlm_gpu_info"}
        assert info == {f"165042301000{i}" for i in range(8)}
        assert value(samples, "rlm_exporter_errors_total", source="rundir") >= 1  # run-garbled
        assert value(samples, "rlm_run_unreadable", run="run-garbled", file="status.json") == 1

        assert value(samples, "rlm_run_step", run="run-a") == 120
        assert value(samples, "rlm_run_state", run="run-a", state="running") == 1
        assert value(samples, "rlm_run_state", run="run-a", state="failed") == 0
        assert value(samples, "rlm_run_restarts_total", run="run-a") == 1
        assert value(samples, "rlm_run_checkpoint_failures_total", run="run-a") == 1
        assert value(samples, "rlm_run_checkpoint_step", run="run-a") == 100  # 110 is partial
        assert 0 <= value(samples, "rlm_run_checkpoint_age_seconds", run="run-a") < 60
        assert value(samples, "rlm_run_checkpoint_interval_steps", run="run-a") == 50
        assert value(samples, "rlm_run_step_duration_seconds", run="run-a") == 0.8
        assert value(samples, "rlm_run_comm_duration_seconds", run="run-a") == 0.2
        assert (
            abs(value(samples, "rlm_run_last_step_timestamp_seconds", run="run-a") - time.time())
            < 60
        )
        assert not any(labels and ("run", "not-a-run") in labels for _, labels in samples)

        # Other trainers may run on this machine: look for ours, not for a total.
        assert value(samples, "rlm_trainer_processes") >= 1
        assert value(samples, "rlm_trainer_resident_memory_bytes", pid=str(trainer.pid)) > 1e6
        assert value(samples, "rlm_trainer_open_fds", pid=str(trainer.pid)) >= 3
        # Its run, from run_dir=: joined onto this host's GPU series by the rules (rlm:host_run).
        assert value(samples, "rlm_run_workers", run="run-a") >= 1

        fs_samples = {
            name: v for (name, labels), v in samples.items() if name.startswith("rlm_shared_fs_")
        }
        assert fs_samples["rlm_shared_fs_size_bytes"] >= fs_samples["rlm_shared_fs_avail_bytes"] > 0
        assert fs_samples["rlm_shared_fs_mounted"] in (0, 1)
        assert any(n == "rlm_network_receive_bytes_total" for n, _ in samples)

        # Every exporter series the rules and the dashboard use exists under that exact name.
        expressions = [rule["expr"] for rule in rules()] + dashboard_queries()
        expressions += annotation_queries()
        used = {n for e in expressions for n in re.findall(r"rlm_(?!train_)[a-z_]*[a-z]", e)}
        if not any(exporter.link_speed_bytes(device) for device in os.listdir("/sys/class/net")):
            used.discard("rlm_network_speed_bytes")  # no interface here reports a link speed
        # Per-rank series come from the ranks' own timings (ranks.json), which this stand-in run
        # does not write: tests/monitoring/test_goodput_series.py scrapes them from real ranks.
        used -= {"rlm_rank_slowness_ratio", "rlm_rank_straggler", "rlm_run_stragglers"}
        assert used and used <= names(samples)
        # ... and every series it exports feeds a rule or a panel, except these documented
        # identity/diagnostic series (docs/monitoring.md, Metrics) that an operator reads by hand.
        read_by_hand = {
            "rlm_exporter_gpu_source_info",  # which vendor tool this node's exporter uses
            "rlm_gpu_info",  # serial/UUID for the RMA (runbooks: GpuXidCritical, GpuMissing)
            "rlm_run_checkpoint_step",  # which step a resume starts from
            "rlm_shared_fs_mounted",  # rlmctl health's shared_fs check judges the mount
            "rlm_trainer_open_fds",  # a file-descriptor leak, read when EMFILE shows up
            # The inputs of the checkpoint interval (docs/scale.md), read when tuning it.
            "rlm_run_interruptions",
            "rlm_run_restart_cost_seconds",
            "rlm_run_at_risk_seconds",
        }
        exported = {n.removesuffix("_total") for n in names(samples) if n.startswith("rlm_")}
        assert exported - {n.removesuffix("_total") for n in used} == read_by_hand
        trainer.kill()
        trainer.wait()
        wait_for(
            lambda: value(scrape(port), "rlm_trainer_open_fds", pid=str(trainer.pid)) is None,
            what="the killed trainer's series to go",
        )
    finally:
        trainer.kill()
        trainer.wait()


def test_hanging_tool_counts_errors_drops_gpu_series_and_keeps_serving(
    tool_bin, run_exporter
) -> None:
    flag = tool_bin / "hang"
    # Prints the fixture until the flag file appears, then hangs like a wedged driver would.
    install_tool(
        tool_bin,
        "amd-smi",
        f"if [ -e '{flag}' ]; then sleep 300 & wait; fi\n" + printing("amd-smi-metric-8gpu.json"),
    )
    port = run_exporter("--gpu-source", "amd-smi", "--interval", "0.5")
    wait_for(lambda: value(scrape(port), GPU_SERIES, gpu="7") == 67, what="amd-smi readings")
    flag.touch()
    samples = wait_for(
        lambda: (s := scrape(port)) and GPU_SERIES not in names(s) and s, what="GPU series to go"
    )
    assert value(samples, "rlm_exporter_source_up", source="amd-smi") == 0
    wait_for(
        lambda: value(scrape(port), "rlm_exporter_errors_total", source="amd-smi"), what="error"
    )
    flag.unlink()
    wait_for(lambda: value(scrape(port), GPU_SERIES, gpu="0") == 71, what="recovery")


def scrape_after_errors(port: int, source: str, at_least: int):
    """The first scrape that counts at least `at_least` errors of `source`."""
    return wait_for(
        lambda: (
            (s := scrape(port))
            and (value(s, "rlm_exporter_errors_total", source=source) or 0) >= at_least
            and s
        ),
        what=f"{at_least} {source} errors",
    )


def test_garbage_printing_tool_counts_errors_and_exports_no_gpu_series(
    tool_bin, run_exporter
) -> None:
    install_tool(tool_bin, "rocm-smi", "echo 'ERROR: rocm_smi_lib: driver not initialized'")
    port = run_exporter("--gpu-source", "rocm-smi", "--interval", "0.3")
    samples = scrape_after_errors(port, "rocm-smi", 2)
    assert not any(name.startswith("rlm_gpu_") for name in names(samples))
    assert value(samples, "rlm_exporter_source_up", source="rocm-smi") == 0
    assert value(samples, "rlm_exporter_gpu_source_info", source="rocm-smi") == 1


def test_partial_nvidia_output_exports_the_readable_gpus_and_counts_the_error(
    tool_bin, run_exporter
) -> None:
    install_tool(tool_bin, "nvidia-smi", printing_nvidia("nvidia-smi-partial.csv", exit_code=15))
    install_tool(
        tool_bin,
        "dmesg",
        "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1",
    )
    port = run_exporter("--gpu-source", "nvidia-smi", "--interval", "2")
    samples = wait_for(
        lambda: (s := scrape(port)) and value(s, GPU_SERIES, gpu="0", uuid=uuid(0)) and s,
        what="GPU series",
    )
    temperatures = {dict(labels)["gpu"] for n, labels in samples if n == GPU_SERIES}
    assert temperatures == {"0", "1", "3", "4", "5", "6", "7"}
    assert value(samples, "rlm_gpu_power_watts", gpu="4", uuid=uuid(4)) is None  # [N/A]: no series
    assert value(samples, "rlm_gpus_seen") == 7
    assert value(samples, "rlm_exporter_errors_total", source="nvidia-smi") >= 1
    assert value(samples, "rlm_exporter_errors_total", source="dmesg") >= 1
    assert value(samples, "rlm_exporter_source_up", source="dmesg") == 0
    assert "rlm_gpu_xid_errors_total" not in names(samples)


def test_gpu_that_falls_off_the_bus_stays_visible_with_its_xid(tool_bin, run_exporter) -> None:
    """All 8 listed; then GPU 2 falls off (XID 79) and later nvidia-smi fails outright."""
    state = tool_bin / "state"
    state.write_text("healthy")
    healthy = printing_nvidia("nvidia-smi-8gpu.csv")
    partial = printing_nvidia("nvidia-smi-partial.csv", exit_code=15)
    install_tool(
        tool_bin,
        "nvidia-smi",
        f"case $(cat '{state}') in healthy) {healthy};; partial) {partial};;\n"
        "*) echo 'Unable to determine the device handle for GPU0000:3A:00.0: Unknown Error'; exit 15;;"
        "\nesac",
    )
    install_tool(
        tool_bin, "dmesg", f"[ \"$(cat '{state}')\" = healthy ] || {printing('dmesg-xid.txt')}"
    )
    port = run_exporter("--gpu-source", "nvidia-smi", "--interval", "2", "--expected-gpus", "8")
    wait_for(lambda: value(scrape(port), "rlm_gpus_seen") == 8, what="8 GPUs")
    gone = {"gpu": "2", "uuid": uuid(2), "pci_bus": "0000:3a:00"}
    state.write_text("partial")
    samples = wait_for(
        lambda: (s := scrape(port)) and value(s, "rlm_gpu_present", **gone) == 0 and s,
        what="GPU 2 reported gone",
    )
    assert value(samples, "rlm_gpus_seen") == 7
    assert value(samples, "rlm_gpu_present", gpu="3", uuid=uuid(3), pci_bus="0000:5d:00") == 1
    wait_for(lambda: xids(scrape(port)).get(("2", "3a", "79")) == 1, what="XID 79 of GPU 2")
    state.write_text("failing")  # nvidia-smi lists nothing any more: the kernel log still counts
    samples = wait_for(
        lambda: (s := scrape(port)) and value(s, "rlm_gpus_seen") == 0 and s, what="no GPUs"
    )
    assert value(samples, "rlm_exporter_source_up", source="nvidia-smi") == 0
    assert value(samples, "rlm_exporter_source_up", source="dmesg") == 1
    assert xids(samples)[("2", "3a", "79")] == 1 and xids(samples)[("7", "db", "48")] == 1
    assert value(samples, "rlm_gpu_present", **gone) == 0
    assert GPU_SERIES not in names(samples)


def test_xids_of_a_gpu_never_listed_keep_their_pci_address(tool_bin, run_exporter) -> None:
    install_tool(tool_bin, "nvidia-smi", "echo 'No devices were found'; exit 6")
    install_tool(tool_bin, "dmesg", printing("dmesg-xid.txt"))
    port = run_exporter("--gpu-source", "nvidia-smi", "--interval", "0.3")
    samples = wait_for(lambda: (s := scrape(port)) and xids(s) and s, what="XIDs")
    assert xids(samples) == {("", "3a", "79"): 1, ("", "db", "48"): 1, ("", "db", "63"): 1}
    assert value(samples, "rlm_gpus_seen") == 0


def test_error_counters_start_at_zero_for_every_source(tmp_path, tool_bin, run_exporter) -> None:
    install_tool(tool_bin, "nvidia-smi", printing_nvidia("nvidia-smi-8gpu.csv"))
    install_tool(tool_bin, "dmesg", printing("dmesg-xid.txt"))
    port = run_exporter("--run-root", str(tmp_path), "--interval", "0.5")
    samples = scrape(port)  # the first scrape, before any source has run
    for source in ("nvidia-smi", "dmesg", "rundir", "sharedfs"):
        assert value(samples, "rlm_exporter_errors_total", source=source) == 0, source


def test_warnings_are_rate_limited_per_source(caplog) -> None:
    now = [0.0]
    errors = exporter.ErrorCounts(["nvidia-smi"], log_every_s=300, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="rlm-exporter"):
        for second in range(0, 600, 10):  # two different complaints every interval
            now[0] = float(second)
            errors.count("nvidia-smi", "exited with 15: Unable to determine the device handle")
            errors.count("nvidia-smi", "unreadable nvidia-smi line: Unable to determine")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, lines
    assert "59 more errors since the last line" in lines[1]
    assert dict(errors.items()) == {"nvidia-smi": 120}


def test_a_probes_errors_appear_with_its_result_not_while_it_runs() -> None:
    """A probe that meets an unreadable file counts it and goes on; the error belongs to the
    result it publishes at the end. Counted at once, a scrape taken meanwhile showed the error
    beside the previous result, or none (the run probe, a race a test tripped over)."""
    errors = exporter.ErrorCounts(["rundir"])
    met_the_error, may_finish = threading.Event(), threading.Event()

    def probe() -> str:
        errors.count("rundir", "cannot read status.json of run directory /runs/a")
        met_the_error.set()
        assert may_finish.wait(30)
        return "runs"

    source = exporter.Source("rundir", probe, interval_s=60, errors=errors)
    refresh = threading.Thread(target=source.refresh)
    refresh.start()
    assert met_the_error.wait(30)
    assert (dict(errors.items()), source.snapshot()) == ({"rundir": 0}, (False, None))
    may_finish.set()
    refresh.join(30)
    assert (dict(errors.items()), source.snapshot()) == ({"rundir": 1}, (True, "runs"))
    errors.count("rundir", "counted at once outside a probe")
    assert dict(errors.items()) == {"rundir": 2}


def test_no_gpu_tool_means_no_gpu_series(tool_bin, run_exporter, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tool_bin))
    port = run_exporter("--interval", "0.5")
    samples = scrape(port)
    assert value(samples, "rlm_exporter_gpu_source_info", source="none") == 1
    assert not any(name.startswith("rlm_gpu_") for name in names(samples))


def test_unreadable_or_malformed_run_files_are_counted_and_exported(tmp_path, run_exporter) -> None:
    """A run whose status.json is garbage, or whose events.jsonl cannot be opened, showed with no
    state and an error counter at 0: nothing could fire. Each is counted and named per run."""
    runs = tmp_path / "runs"
    make_run(runs, "good")
    garbled = make_run(runs, "garbled")
    garbled.status_path.write_text('{"state": "running", "step": 12')  # not JSON: torn by hand
    locked = make_run(runs, "locked")
    locked.events_path.unlink()
    locked.events_path.mkdir()  # unreadable even for root, unlike a chmod
    elsewhere = make_run(tmp_path / "elsewhere", "explicit", step=7)
    port = run_exporter(
        "--run-root", str(runs), "--run-dir", str(elsewhere.path),
        "--interval", "0.5", "--gpu-source", "none",
    )  # fmt: skip
    # Both runs counted: the errors show with the probe result they belong to (Source.refresh),
    # so the first scrape that has them has the runs too; it once had the errors alone.
    samples = scrape_after_errors(port, "rundir", 2)
    assert value(samples, "rlm_run_unreadable", run="garbled", file="status.json") == 1
    assert value(samples, "rlm_run_unreadable", run="locked", file="events.jsonl") == 1
    assert value(samples, "rlm_run_unreadable", run="good", file="status.json") is None
    # The directory itself was read: the source is up, the readable runs are exported.
    assert value(samples, "rlm_exporter_source_up", source="rundir") == 1
    assert value(samples, "rlm_run_step", run="good") == 120
    assert value(samples, "rlm_run_step", run="explicit") == 7
    assert value(samples, "rlm_run_step", run="garbled") is None


def test_a_run_root_that_cannot_be_listed_takes_the_source_down(tmp_path, run_exporter) -> None:
    runs = tmp_path / "runs"
    runs.write_text("not a directory")  # listing it fails, as a lost mount's EIO does
    port = run_exporter("--run-root", str(runs), "--interval", "0.5", "--gpu-source", "none")
    samples = scrape_after_errors(port, "rundir", 1)
    assert value(samples, "rlm_exporter_source_up", source="rundir") == 0


def write_exit_record(run: RunDir, host: str, code: int, when: float) -> None:
    run.host_dir(host).mkdir(parents=True, exist_ok=True)
    write_json_atomic(run.exit_record_path(host), {"exit_code": code, "time": int(when)})


def test_exit_code_of_the_newest_attempt(tmp_path, run_exporter) -> None:
    runs = tmp_path / "runs"
    # A worker SIGKILLed (OOM killer): status.json still says running, its torchrun exited 137
    # (hosts/<host>/exit.json as rlmctl's launcher writes it: whole seconds).
    killed = make_run(runs, "killed")
    write_exit_record(killed, "node1", 0, time.time())
    write_exit_record(killed, "node2", 137, time.time())
    # The failure belongs to the attempt before the newest start: nothing has exited since.
    restarted = make_run(runs, "restarted")
    write_exit_record(restarted, "node1", 1, 1000)
    # The trainer itself said 3 (data error) in its exit event.
    bad_data = make_run(runs, "bad-data", state="failed")
    bad_data.append_event("exit", exit_code=3, state="failed", step=120)
    clean = make_run(runs, "clean", state="stopped")
    clean.append_event("exit", exit_code=0, state="stopped", step=120)
    port = run_exporter("--run-root", str(runs), "--interval", "0.5", "--gpu-source", "none")
    samples = wait_for(
        lambda: (s := scrape(port)) and value(s, "rlm_run_step", run="clean") and s,
        what="the runs",
    )
    assert value(samples, "rlm_run_exit_code", run="killed") == 137
    assert value(samples, "rlm_run_exit_code", run="restarted") is None
    assert value(samples, "rlm_run_exit_code", run="bad-data") == 3
    assert value(samples, "rlm_run_exit_code", run="clean") == 0


def test_missing_run_root_keeps_serving(tmp_path, run_exporter) -> None:
    port = run_exporter("--run-root", str(tmp_path / "not-mounted-yet"), "--interval", "0.5")
    samples = wait_for(
        lambda: (s := scrape(port)) and "rlm_exporter_source_up" in names(s) and s,
        what="exporter metrics",
    )
    assert not any(name.startswith("rlm_run_") for name in names(samples))
    assert value(samples, "rlm_exporter_source_up", source="sharedfs") == 0


def test_finished_runs_disappear_after_an_hour(tmp_path) -> None:
    run = make_run(tmp_path, state="done")
    snapshot = exporter.read_run(run.path)
    assert exporter.is_visible(snapshot, time.time())
    assert not exporter.is_visible(snapshot, time.time() + 2 * 3600)


TORCHRUN = ["python3", "-m", "torch.distributed.run", "--nnodes=1", "-m", "trainer", "train"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/venv/bin/python", "-m", "trainer", "train", "--config", "c.yaml"], True),
        (["/venv/bin/python", "-u", "-m", "trainer", "train"], True),
        (["/venv/bin/rlm-train", "train", "--config", "c.yaml"], True),
        (
            ["/venv/bin/python", "/venv/bin/torchrun", "--nnodes", "2", "-m", "trainer", "train"],
            False,
        ),
        (["/venv/bin/python", "-m", "torch.distributed.run", "-m", "trainer", "train"], False),
        # What starts torchrun: rlmctl's launcher shell (hostproc.start), podman run of an image.
        (["/bin/sh", "-c", hostproc.WRAPPER, "rlmctl-launcher", *TORCHRUN], False),
        (["podman", "run", "--rm", "--network=host", "localhost/rlm:1", *TORCHRUN], False),
        (["/venv/bin/python", "-m", "trainer", "prepare", "--out", "d"], False),
        (["vim", "trainer/train.py"], False),
    ],
)
def test_trainer_process_recognition(argv, expected) -> None:
    assert exporter.runs_trainer(argv) is expected


def test_the_run_of_a_worker_is_its_run_dir_argument() -> None:
    launched = [
        "/venv/bin/python",
        "-u",
        "-m",
        "trainer",
        "train",
        "--config",
        "/s/runs/exp1/c.yaml",
    ]
    assert exporter.run_of([*launched, "run_dir=/lustre/runs/exp1", "train.steps=9"]) == "exp1"
    assert exporter.run_of([*launched, "run_dir=/lustre/runs/exp2/"]) == "exp2"
    assert exporter.run_of(launched) == ""


def test_link_speed_unknown_is_none(tmp_path) -> None:
    assert exporter.link_speed_bytes("no-such-device0") is None


def test_importing_the_exporter_does_not_import_torch() -> None:
    code = "import sys, monitoring.exporter; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_port_in_use_is_one_line_error(run_exporter) -> None:
    port = run_exporter("--gpu-source", "none")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "monitoring.exporter",
            "--address",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": os.environ["PATH"]},
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: cannot listen on")


@pytest.mark.parametrize(
    "argv",
    [["--interval", "x"], ["--interval", "0"], ["--gpu-source", "cuda"], ["--port"]],
)
def test_bad_arguments_are_one_line_errors(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        exporter.parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_event_times_for_the_dashboards_annotations(tmp_path: Path) -> None:
    """rlm_run_event_timestamp_seconds: the newest event of each kind in events.jsonl, read by
    the dashboard's Launches, Checkpoints and Failures annotations."""
    run = RunDir(tmp_path / "runs" / "run-e").create()
    run.append_event("launched")
    first = run.append_event("checkpoint", step=10)
    last = run.append_event("checkpoint", step=20)
    failed = run.append_event("failure", reason="exit 1")
    write_json_atomic(run.status_path, {"state": "running", "step": 20, "updated": time.time()})
    once = subprocess.run(
        [sys.executable, "-m", "monitoring.exporter", "--once", "--gpu-source", "none",
         "--run-root", str(tmp_path / "runs")],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    found = {
        m[0]: float(m[1])
        for m in re.findall(
            r'rlm_run_event_timestamp_seconds\{event="([a-z_]+)",run="run-e"\} (\S+)', once.stdout
        )
    }
    assert set(found) == {"launched", "checkpoint", "failure"}, once.stdout
    assert found["checkpoint"] == pytest.approx(last.time) and last.time >= first.time
    assert found["failure"] == pytest.approx(failed.time)

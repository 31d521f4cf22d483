"""The monitoring chain end to end on the multi-host rig, with the real Debian binaries.

Three rig hosts run prometheus-node-exporter and rlm-exporter (GPU readings from a stand-in
nvidia-smi answering from the fixture; node2's GPU 3 runs hot), node1+node2 run a tiny training
run under torchrun/gloo on the shared directory. Prometheus on the real host scrapes them with the
shipped config (targets generated from the rig's inventory by monitoring.file_sd, node3 in the
`drained` group) and the shipped rules, rendered with `for: 0s`, 1 s intervals and a short stall
threshold; it sends to a real Alertmanager running the shipped routing with its receivers
rendered by monitoring.alertmanager_config: one webhook, a real HTTP server in this test. Here:
every recording rule and dashboard query returns data, a drained host's alerts are inhibited, a
dead node's GPU alerts are inhibited. Faults delivered to a webhook by the roles' own deployment
(a stalled trainer, a failed run, a lost GPU, an XID, a stopped exporter, the Watchdog) are tested
on systemd nodes: tests/ansible/test_site_systemd.py, alerting section.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from monitoring import alertmanager_config, file_sd
from rlmctl.inventory import load
from tests.monitoring import conftest
from tests.monitoring.alerting_site import WebhookReceiver
from tests.monitoring.conftest import FIXTURES, STANDIN_NVIDIA_SMI
from tests.monitoring.test_config import MONITORING, dashboard_queries, rules
from tests.ports import free_port
from tests.rig import Rig

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"
BINARIES = ("/usr/bin/prometheus", "/usr/bin/prometheus-alertmanager")
NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
STALL_SECONDS = 15  # the rendered rlm:tunable_training_stall_seconds (600 s in production)
# Stated delivery time on this rig (1 s scrapes and evaluations, 1 s group_wait, 2 s
# group_interval): a fault's notification reaches the webhook this long after it shows.
DELIVERY_S = 45
RUN = "e2e"
# Series the rig cannot have, so their rules and panels return nothing there (and only those):
# the rig hosts have no RDMA NIC (no /sys/class/infiniband for node_exporter's collector); no
# dcgm-exporter or AMD device-metrics exporter runs there (the :dcgm and :vendor rules read only
# theirs); the rig's stand-in nvidia-smi answers the temperature/memory query alone, not the PCIe
# replay and NVLink counters (tests/monitoring/test_exporter.py and the promtool tests cover
# those rules on recorded output).
NO_DATA_ON_THE_RIG = (
    "rlm:rdma_",
    "rlm:gpu_clock_event_reasons:dcgm",
    "rlm:gpu_interconnect_errors:",
    "rlm:gpu_pcie_replays:",
)

pytestmark = [
    pytest.mark.rig,
    pytest.mark.skipif(os.geteuid() != 0, reason="the rig needs root"),
    pytest.mark.skipif(
        not all(os.path.exists(b) for b in (*BINARIES, NODE_EXPORTER)),
        reason="needs the Debian packages prometheus, prometheus-alertmanager, "
        "prometheus-node-exporter",
    ),
]


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def render_alertmanager(out: Path, webhook_url: str) -> Path:
    """The shipped routing with one webhook receiver, grouped and resent within seconds."""
    config = alertmanager_config.render({"rlm_alert_webhook_url": webhook_url})
    routes = [config["route"], *config["route"]["routes"]]
    for route in routes:
        route.update(group_wait="1s", group_interval="2s")
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def wait_for(condition: Any, timeout_s: float, what: Any) -> Any:
    # Half-second polls: each poll of the stack is a handful of HTTP queries.
    return conftest.wait_for(condition, timeout_s, what, poll_s=0.5)


@dataclass
class Stack:
    rig: Rig
    shared: Path
    prometheus: str  # base URL
    alertmanager: str
    webhook: WebhookReceiver

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        return get_json(url)["data"]["result"]

    def alerts(self, name: str, state: str = "firing") -> list[dict[str, str]]:
        found = get_json(f"{self.prometheus}/api/v1/alerts")["data"]["alerts"]
        return [
            a["labels"] for a in found if a["labels"]["alertname"] == name and a["state"] == state
        ]

    def am_alerts(self, name: str) -> list[dict[str, Any]]:
        url = f"{self.alertmanager}/api/v2/alerts?" + urllib.parse.urlencode(
            {"filter": f'alertname="{name}"'}
        )
        return get_json(url)

    def pid(self, host: str, name: str) -> int:
        return int((self.shared / "e2e" / f"{host}-{name}.pid").read_text())

    def log_tail(self, host: str, name: str) -> str:
        path = self.shared / "e2e" / f"{host}-{name}.log"
        return path.read_text(errors="replace")[-1500:] if path.exists() else "(no log)"


def start_in_node(rig: Rig, host: str, name: str, command: str, state: Path) -> None:
    """Start `command` detached inside the rig host; its pid and log go to the shared dir."""
    pid_file, log = state / f"{host}-{name}.pid", state / f"{host}-{name}.log"
    inner = f"echo $$ > {pid_file}; exec {command} > {log} 2>&1 < /dev/null"
    rig.exec(host, f"setsid sh -c {shlex.quote(inner)} > /dev/null 2>&1 < /dev/null &")


def fake_nvidia_smi(bin_dir: Path, hot_gpu: int | None) -> None:
    """A stand-in nvidia-smi answering from the 8-GPU fixture (optionally one GPU at 95 °C)."""
    bin_dir.mkdir(parents=True)
    rows = (FIXTURES / "nvidia-smi-8gpu.csv").read_text().splitlines()
    if hot_gpu is not None:
        cells = rows[hot_gpu].split(", ")
        cells[5] = "95"  # temperature.gpu
        rows[hot_gpu] = ", ".join(cells)
    (bin_dir / "nvidia-smi.csv").write_text("\n".join(rows) + "\n")
    (bin_dir / "nvidia-smi").write_text(
        f'#!/bin/sh\nexec {sys.executable} {STANDIN_NVIDIA_SMI} {bin_dir / "nvidia-smi.csv"} -- "$@"\n'
    )
    (bin_dir / "dmesg").write_text(f"#!/bin/sh\ncat '{FIXTURES / 'dmesg-xid.txt'}'\n")
    for tool in ("nvidia-smi", "dmesg"):
        (bin_dir / tool).chmod(0o755)


def render_rules(out: Path) -> None:
    """The shipped rules with every `for` removed and the stall threshold shortened."""
    out.mkdir()
    for path in sorted((MONITORING / "prometheus" / "rules").glob("*.yml")):
        document = yaml.safe_load(path.read_text())
        for group in document["groups"]:
            for rule in group["rules"]:
                rule.pop("for", None)
                if rule.get("record") == "rlm:tunable_training_stall_seconds":
                    rule["expr"] = f"vector({STALL_SECONDS})"
        (out / path.name).write_text(yaml.safe_dump(document, sort_keys=False))


def render_prometheus(config_dir: Path, inventory: Path, port: int, am_port: int) -> Path:
    config_dir.mkdir()
    config = yaml.safe_load((MONITORING / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [
        f"127.0.0.1:{am_port}"
    ]
    for job in config["scrape_configs"]:
        job.pop("scrape_interval", None)
        if job["job_name"] == "prometheus":
            job["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
        if job["job_name"] == "alertmanager":
            job["static_configs"][0]["targets"] = [f"127.0.0.1:{am_port}"]
    path = config_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    render_rules(config_dir / "rules")
    file_sd.write_targets(file_sd.target_groups(load(inventory)), config_dir / "targets")
    return path


def drained_inventory(rig: Rig, out: Path) -> Path:
    """The rig's inventory with node3 in the `drained` group."""
    inventory = yaml.safe_load(rig.inventory_path.read_text())
    inventory["all"]["children"]["drained"] = {"hosts": {"node3": None}}
    out.write_text(yaml.safe_dump(inventory))
    return out


def trainer_command(shared: Path, node_rank: int) -> str:
    overrides = [
        f"run_dir={shared}/runs/{RUN}",
        f"data.path={shared}/data",
        "train.steps=100000",
        "train.global_batch=2",
        "train.micro_batch=1",
        "model.mean_recurrence=2",
        "metrics.port=9401",
        "metrics.log_every=1",
        "checkpoint.interval_steps=2",
        "eval.every=3",
        "eval.batches=1",
    ]
    return (
        "env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 "
        f"{VENV_BIN}/torchrun --nnodes 2 --nproc-per-node 1 --node-rank {node_rank} "
        "--master-addr node1 --master-port 29500 -m trainer train "
        f"--config {ROOT}/trainer/configs/tiny.yaml " + " ".join(overrides)
    )


def exporter_command(shared: Path, host: str) -> str:
    bin_dir = shared / "e2e" / f"bin-{host}"
    return (
        f"env PATH={bin_dir}:/usr/bin:/bin {VENV_BIN}/rlm-exporter "
        f"--gpu-source nvidia-smi --run-root {shared}/runs --interval 1 --expected-gpus 8"
    )


def start_local(*argv: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("e2e")
    rig = Rig(3, slot=1).up()
    processes: list[subprocess.Popen[bytes]] = []
    try:
        shared = rig.shared_dir
        state = shared / "e2e"
        state.mkdir()
        (shared / "runs").mkdir()
        prepare = subprocess.Popen(
            [f"{VENV_BIN}/python", "-m", "trainer", "prepare", "--out", str(shared / "data")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for host in rig.hosts:
            bin_dir = state / f"bin-{host.name}"
            # node2's GPU 3 runs hot, and so does drained node3's (inhibited in Alertmanager).
            fake_nvidia_smi(bin_dir, hot_gpu=3 if host.name in ("node2", "node3") else None)
            start_in_node(
                rig, host.name, "node-exporter",
                f"{NODE_EXPORTER} --web.listen-address={host.ip}:9100", state,
            )  # fmt: skip
            start_in_node(
                rig, host.name, "rlm-exporter", exporter_command(shared, host.name), state
            )
        _, err = prepare.communicate(timeout=300)
        assert prepare.returncode == 0, err.decode()[-500:]
        for rank, host in enumerate(("node1", "node2")):
            start_in_node(rig, host, "trainer", trainer_command(shared, rank), state)

        prom_port, am_port = free_port(), free_port()
        webhook = WebhookReceiver()
        am_config = render_alertmanager(tmp / "alertmanager.yml", webhook.url)
        inventory = drained_inventory(rig, tmp / "inventory.yml")
        config = render_prometheus(tmp / "prometheus", inventory, prom_port, am_port)
        processes.append(
            start_local(
                BINARIES[1],
                f"--config.file={am_config}",
                f"--storage.path={tmp / 'alertmanager-data'}",
                f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address=",
                log=tmp / "alertmanager.log",
            )
        )
        processes.append(
            start_local(
                BINARIES[0],
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                log=tmp / "prometheus.log",
            )
        )
        yield Stack(
            rig, shared, f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{am_port}", webhook
        )
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        rig.down()


def test_every_target_is_up(stack: Stack) -> None:
    def targets() -> dict[tuple[str, str], str]:
        active = get_json(f"{stack.prometheus}/api/v1/targets")["data"]["activeTargets"]
        return {(t["labels"]["job"], t["labels"].get("host", "")): t["health"] for t in active}

    # Only rank 0 (node1) serves the trainer endpoint; node2/node3's trainer targets stay down.
    by_design_down = {("rlm-trainer", "node2"), ("rlm-trainer", "node3")}

    expected = {
        (job, host)
        for job in ("node", "rlm-exporter", "rlm-trainer")
        for host in ("node1", "node2", "node3")
    } | {("prometheus", ""), ("alertmanager", "")}  # no dcgm/AMD: rlm_gpu_vendor none

    def all_up() -> bool:
        found = targets()
        return set(found) == expected and all(
            health == "up" for key, health in found.items() if key not in by_design_down
        )

    wait_for(
        all_up,
        240,
        lambda: f"targets {targets()}; node1 trainer: {stack.log_tail('node1', 'trainer')}",
    )
    drained = stack.query('up{host="node3", drained="true"}')
    assert {sample["metric"]["job"] for sample in drained} == {
        "node",
        "rlm-exporter",
        "rlm-trainer",
    }


def test_every_recording_rule_and_dashboard_query_returns_data(stack: Stack) -> None:
    expressions = [rule["record"] for rule in rules() if "record" in rule]
    expressions += [
        q.replace("$__rate_interval", "10s").replace('"$run"', '".*"').replace('"$host"', '".*"')
        for q in dashboard_queries()
    ]

    expressions = [e for e in expressions if not any(n in e for n in NO_DATA_ON_THE_RIG)]

    def missing() -> list[str]:
        return [expr for expr in expressions if not stack.query(expr)]

    wait_for(lambda: not missing(), 300, lambda: f"no data for {missing()}")
    # One query each, retried: a scrape that times out on a loaded machine (1 s interval and
    # timeout here) marks its series stale, and an instant query then returns nothing for them.
    gpu = wait_for(
        lambda: stack.query('rlm:gpu_temperature_celsius{host="node2", gpu="3"}'),
        60,
        "node2's GPU 3 in rlm:gpu_temperature_celsius",
    )
    assert float(gpu[0]["value"][1]) == 95
    active = wait_for(
        lambda: stack.query(f'rlm:run_active{{run="{RUN}"}}'), 60, f"rlm:run_active for {RUN}"
    )
    assert float(active[0]["value"][1]) == 1


def test_a_drained_hosts_alerts_are_inhibited_and_never_delivered(stack: Stack) -> None:
    """node3 is drained and its GPU 3 runs hot like node2's: Alertmanager holds node3's GpuTooHot
    suppressed by node3's HostDrained; the webhook gets node2's and never node3's."""

    def hot_on(host: str) -> list[dict[str, Any]]:
        return [a for a in stack.am_alerts("GpuTooHot") if a["labels"]["host"] == host]

    suppressed = wait_for(
        lambda: [a for a in hot_on("node3") if a["status"]["state"] == "suppressed"],
        60,
        lambda: f"node3's GpuTooHot suppressed in Alertmanager; it has {hot_on('node3')}",
    )
    drained = [a for a in stack.am_alerts("HostDrained") if a["labels"]["host"] == "node3"]
    assert drained, stack.am_alerts("HostDrained")
    assert suppressed[0]["status"]["inhibitedBy"] == [drained[0]["fingerprint"]]
    delivered = wait_for(
        lambda: {a["labels"]["host"] for _, a in stack.webhook.alerts("GpuTooHot", "firing")},
        DELIVERY_S,
        "node2's GpuTooHot at the webhook",
    )
    assert delivered == {"node2"}
    assert not stack.webhook.alerts(
        "HostDrained", "firing"
    )  # info: the receiver that sends nothing


def test_node_down_fires_and_inhibits_that_nodes_gpu_alerts_but_not_for_a_drained_node(
    stack: Stack,
) -> None:
    def hot_gpu_alerts() -> list[dict[str, Any]]:
        return [a for a in stack.am_alerts("GpuTooHot") if a["labels"]["host"] == "node2"]

    active = wait_for(
        lambda: [a for a in hot_gpu_alerts() if a["status"]["state"] == "active"],
        60,
        "GpuTooHot for node2 in Alertmanager",
    )
    assert active[0]["labels"]["gpu"] == "3"
    # A scrape can time out on a loaded machine; what matters is which hosts NodeDown names.
    wait_for(lambda: not stack.alerts("NodeDown"), 30, "no NodeDown before the kill")

    for host in ("node2", "node3"):
        os.kill(stack.pid(host, "node-exporter"), signal.SIGTERM)
    wait_for(
        lambda: "node2" in {a["host"] for a in stack.alerts("NodeDown")},
        60,
        lambda: f"NodeDown for node2; firing: {stack.alerts('NodeDown')}",
    )
    suppressed = wait_for(
        lambda: [a for a in hot_gpu_alerts() if a["status"]["state"] == "suppressed"],
        60,
        lambda: f"GpuTooHot on node2 to be inhibited; Alertmanager has {hot_gpu_alerts()}",
    )
    assert suppressed[0]["status"]["inhibitedBy"], suppressed
    node_down = [a for a in stack.am_alerts("NodeDown") if a["status"]["state"] == "active"]
    assert "node2" in [a["labels"]["host"] for a in node_down]

    # node3 is drained: down for three scrapes (and as many rule evaluations), yet no NodeDown.
    wait_for(
        lambda: stack.query('max_over_time(up{job="node", host="node3"}[3s]) == 0'),
        30,
        "node3 to be seen down for 3 s",
    )
    assert "node3" not in {a["host"] for a in stack.alerts("NodeDown")}
    assert "node3" not in {a["labels"]["host"] for a in stack.am_alerts("NodeDown")}

"""rules/inventory.yml as the prometheus role's template writes it from an inventory, loaded by
promtool next to the shipped rules: a port whose HCA reports no rate is divided by its host's
rlm_rdma_link_gbps (clusterspec default 400 Gb/s, here 200 for one host); the receivers the
inventory sets (AlertmanagerNoReceiver)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clusterspec.variables import default
from tests.ansible.playbook_run import REPO, run_playbook, write_inventory
from tests.monitoring.test_config import MONITORING

TEMPLATE = REPO / "roles" / "prometheus" / "templates" / "inventory-rules.yml.j2"
ROLE_DEFAULTS = REPO / "roles" / "prometheus" / "defaults" / "main.yml"

pytestmark = pytest.mark.skipif(not shutil.which("promtool"), reason="needs promtool (prometheus)")


def test_inventory_link_speeds_reach_the_rdma_rules(tmp_path: Path) -> None:
    out = tmp_path / "rules"
    out.mkdir()
    playbook = tmp_path / "inventory-rules.yml"
    task = {
        "name": "Write the inventory's per-host rules",
        "ansible.builtin.template": {
            "src": str(TEMPLATE),
            "dest": str(out / "inventory.yml"),
            "mode": "0644",
            "validate": "promtool check rules %s",
        },
    }
    play = {
        "name": "Rules",
        "hosts": "mgmt",
        "gather_facts": False,
        # The role's own defaults: the template sees what the role gives it.
        "vars": yaml.safe_load(ROLE_DEFAULTS.read_text()),
        "tasks": [task],
    }
    playbook.write_text(yaml.safe_dump([play], sort_keys=False))
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {
        "all": {
            "children": {
                "mgmt": {"hosts": {"mgmt1": local}},
                "compute": {"hosts": {"node1": None, "node2": {"rlm_rdma_link_gbps": 200}}},
            },
            "vars": {
                "rlm_alert_webhook_url": "http://10.0.0.1:8080/alerts",
                "rlm_alert_pagerduty_routing_key": "0123456789abcdef",
                "rlm_alert_watchdog_url": "https://deadman.example.org/ping/1",  # not a receiver
            },
        }
    }
    result = run_playbook(playbook, write_inventory(tmp_path / "hosts.yml", inventory), tmp_path)
    assert result.rc == 0, (result.failures("mgmt1"), result.stderr[-2000:])

    rules = yaml.safe_load((out / "inventory.yml").read_text())["groups"][0]["rules"]
    speeds = {rule["labels"]["host"]: rule["expr"] for rule in rules if "labels" in rule}
    receivers = {rule["record"]: rule["expr"] for rule in rules if "labels" not in rule}
    assert receivers == {"rlm:inventory_alert_receivers": "vector(2)"}
    assert speeds == {
        "mgmt1": f"vector({int(default('rlm_rdma_link_gbps') * 1e9 / 8)})",
        "node1": "vector(50000000000)",
        "node2": "vector(25000000000)",
    }
    port = 'device="mlx5_0", port="1"'
    case = {
        "rule_files": [str(out / "inventory.yml"), str(MONITORING / "prometheus/rules/node.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": f'node_infiniband_rate_bytes_per_second{{host="node2", {port}}}',
                        "values": "0x10",
                    },
                    {
                        "series": f'node_infiniband_port_data_received_bytes_total{{host="node2", {port}}}',
                        "values": "0+750000000000x10",  # 12.5 GB/s
                    },
                ],
                "promql_expr_test": [
                    {
                        "expr": "rlm:rdma_receive_utilization_ratio",
                        "eval_time": "8m",
                        "exp_samples": [
                            {
                                "labels": f'rlm:rdma_receive_utilization_ratio{{host="node2", {port}}}',
                                "value": 0.5,
                            }
                        ],
                    }
                ],
            }
        ],
    }
    test_file = tmp_path / "rdma-test.yml"
    test_file.write_text(yaml.safe_dump(case, sort_keys=False))
    proc = subprocess.run(
        ["promtool", "test", "rules", str(test_file)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

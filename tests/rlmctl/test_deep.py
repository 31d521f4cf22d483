"""`rlmctl health --deep`: the all-reduce probe for real (torchrun, gloo) and the nccl-tests parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlmctl import deep
from tests.rlmctl.conftest import rlmctl
from trainer.allreduce import bus_bandwidth

# all_reduce_perf output in the nccl-tests format (columns and footer as described in facts.md).
ALL_REDUCE_PERF = """\
# nThread 1 nGpus 8 minBytes 17179869184 maxBytes 17179869184 step: 1048576(bytes) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  40123 on     gpu01 device  0 [0x18] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
 17179869184    4294967296     float     sum      -1  64930.5  264.59  463.03      0  64881.2  264.79  463.38      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 463.205
#
"""


def test_parse_and_judge_all_reduce_perf() -> None:
    parsed = deep.parse_all_reduce_perf(ALL_REDUCE_PERF)
    assert parsed["ok"] and parsed["avg_busbw"] == 463.205
    (row,) = parsed["rows"]
    assert row["size"] == 17179869184 and row["busbw_out"] == 463.03
    assert deep.judge_busbw(parsed, "NVIDIA H100 80GB HBM3", None) is None
    slow = deep.judge_busbw(parsed, "NVIDIA H200", 600.0)
    assert slow and "below 90% of the 600 GB/s floor" in slow
    broken = ALL_REDUCE_PERF.replace("463.38      0", "463.38      3").replace("0 OK", "3 FAILED")
    assert not deep.parse_all_reduce_perf(broken)["ok"]
    assert "wrong results" in deep.judge_busbw(deep.parse_all_reduce_perf(broken), "H100", None)


def test_bus_bandwidth_formula() -> None:
    # nccl-tests: busbw = algbw × 2(n−1)/n
    assert bus_bandwidth(8 * 10**9, 1.0, 8) == 8.0 * 2 * 7 / 8


@pytest.mark.integration
def test_deep_health_runs_a_real_all_reduce(local_inventory: Path) -> None:
    result = rlmctl("-i", str(local_inventory), "health", "--deep", "--json", timeout=300)
    assert result.returncode in (0, 1), result.stderr
    report = json.loads(result.stdout)
    allreduce = report["deep"]["allreduce"]
    assert allreduce["world"] == 2 and allreduce["backend"] == "gloo" and allreduce["correct"]
    assert allreduce["busbw_gbps"] > 0 and report["deep"]["ok"]

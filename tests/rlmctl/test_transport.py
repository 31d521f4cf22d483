"""The communication path: NCCL_DEBUG=INFO logs recorded from public issues (source named in each
fixture) parsed into transports and NICs, and judged against rlm_fabric / rlm_gpudirect."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import yaml

from clusterspec import transport
from rlmctl import deep, inventory

FIXTURES = Path(__file__).parent / "fixtures" / "nccl"


def log(*names: str) -> str:
    return "".join((FIXTURES / name).read_text() for name in names)


def test_every_log_names_its_source() -> None:
    for path in FIXTURES.iterdir():
        assert path.read_text().startswith("# source: https://"), path.name


def test_ib_with_gpudirect() -> None:
    path = transport.parse(log("ib-gdrdma.log"))
    assert len(path.channels) == 12 and path.transports() == {"NET/IB/GDRDMA": 12}
    assert path.channels[0].host == "10-90-43-152" and path.channels[0].gdr
    assert transport.judge(path, "ib", True) == []
    assert "NET/IB/GDRDMA x12" in path.summary()


def test_nics_from_the_net_lines() -> None:
    path = transport.parse(log("ib-using-nics.log"))
    assert path.ib_nics == {"master_node": ["mlx5_0:1/IB"]}
    assert path.socket_ifs == {"master_node": ["ib0:192.168.11.1"]}
    assert transport.judge(path, "ib", None) == []
    # The NICs are InfiniBand, not RoCE: a RoCE inventory is told so.
    assert transport.judge(path, "roce", None) == ["master_node: NICs mlx5_0:1/IB are not roce"]
    sharp = transport.parse(log("ibext-sharp.log"))
    assert len(sharp.ib_nics["ad5b8ae33076"]) == 8 and sharp.networks == {"IBext"}
    assert transport.judge(sharp, "ib", None) == []


def test_socket_fallback_fails_with_the_host_pair_and_transport() -> None:
    path = transport.parse(log("socket-fallback.log"))
    assert path.transports() == {"NET/Socket": 2, "P2P/IPC/read": 6}
    problems = transport.judge(path, "ib", None)
    assert problems[0] == "<cluster_name> <-> rank 6: channel 3 via NET/Socket/3, expected ib"
    assert "uses TCP sockets (NET/Socket)" in problems[-1]
    assert transport.judge(path, "socket", None) == []  # what a socket inventory expects
    assert transport.judge(path, None, None) == []  # rlm_fabric unset: reported, not judged


def test_ib_without_gpudirect_fails_only_when_gpudirect_is_expected() -> None:
    path = transport.parse(log("ib-without-gdr.log"))
    assert path.transports() == {"NET/IB": 4}
    assert transport.judge(path, "ib", None) == []
    (problem,) = transport.judge(path, "ib", True)
    assert "via NET/IB/4 without GPUDirect RDMA" in problem


def test_rank_hosts_name_the_peer() -> None:
    path = transport.parse(log("init-complete.log", "socket-fallback.log"))
    assert path.rank_hosts[6] == "swat1-04"
    assert transport.judge(path, "ib", None)[0].startswith("<cluster_name> <-> swat1-04: ")


def test_intra_node_transports_are_not_judged_against_the_fabric() -> None:
    path = transport.parse(log("p2p-cumem.log"))
    assert path.transports() == {"P2P/CUMEM": 3} and path.channels[0].kind == "p2p"
    assert transport.judge(path, "ib", True) == []


def test_no_nccl_lines() -> None:
    path = transport.parse("gloo: nothing to see\n")
    assert path.summary().startswith("no NCCL transport lines")


def test_roce_knobs_reach_the_training_environment(tmp_path: Path) -> None:
    """rlm_nccl_ib_* become NCCL_IB_* in every host's comm_env (launch, slurm, deep probe);
    an explicit rlm_comm_env entry wins."""
    source = tmp_path / "hosts.yml"
    group = {
        "rlm_fabric": "roce",
        "rlm_gpudirect": True,
        "rlm_nccl_ib_hca": "=mlx5_0,mlx5_1",
        "rlm_nccl_ib_gid_index": 3,
        "rlm_nccl_ib_tc": 106,
        "rlm_comm_env": {"NCCL_IB_TC": "104"},
    }
    node = {"ansible_host": "10.0.0.1"}
    source.write_text(
        yaml.safe_dump({"all": {"children": {"compute": {"hosts": {"n1": node}, "vars": group}}}})
    )
    (host,) = inventory.load(source).select()
    assert host.fabric == "roce" and host.gpudirect is True
    assert host.comm_env == {
        "NCCL_IB_HCA": "=mlx5_0,mlx5_1",
        "NCCL_IB_GID_INDEX": "3",
        "NCCL_IB_TC": "104",
    }
    env = deep.debug_env(host)
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    bad = source.read_text().replace("roce", "rdma")
    source.write_text(bad)
    try:
        inventory.load(source)
    except Exception as error:  # InventoryError: one line naming the variable
        assert "rlm_fabric must be one of ib, roce, socket" in str(error)
    else:
        raise AssertionError("rlm_fabric: rdma was accepted")


def test_deep_gate_fails_on_a_socket_fallback(tmp_path: Path) -> None:
    source = tmp_path / "hosts.yml"
    source.write_text(yaml.safe_dump({"all": {"hosts": {"n1": {"rlm_fabric": "ib"}}}}))
    (host,) = inventory.load(source).select()
    result = deep.DeepResult(ok=True, allreduce=None)
    deep.judge_comm_path(host, log("socket-fallback.log"), result)
    assert result.comm_path["n1"]["transports"]["NET/Socket"] == 2
    assert (
        result.problems[0]
        == "n1: <cluster_name> <-> rank 6: channel 3 via NET/Socket/3, expected ib"
    )
    clean = deep.DeepResult(ok=True, allreduce=None)
    deep.judge_comm_path(replace(host, fabric="socket"), log("socket-fallback.log"), clean)
    assert clean.problems == [] and "NET/Socket x2" in clean.summary()


def test_trainer_records_its_own_comm_path(tmp_path: Path, monkeypatch) -> None:
    """The trainer's start-up hook: NCCL's log goes to the run directory, and is read back."""
    from trainer import comm_path

    for name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):
        monkeypatch.delenv(name, raising=False)
    log_file = comm_path.capture(tmp_path)
    assert os.environ["NCCL_DEBUG"] == "INFO" and os.environ["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert os.environ["NCCL_DEBUG_FILE"] == str(tmp_path / comm_path.LOG_DIR / "%h.%p.log")
    assert comm_path.describe(log_file) is None  # nothing logged yet (or gloo)
    log_file.write_text(log("ib-gdrdma.log"))  # what NCCL writes there (%h.%p expanded)
    assert comm_path.describe(log_file)["summary"] == "NET/IB/GDRDMA x12"
    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # the site's own choice is left alone
    assert comm_path.capture(tmp_path) is None

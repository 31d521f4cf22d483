"""GPU topology: the parsers on recorded tool output (sources named in each fixture) and the
health gate's verdicts: healthy, one NVLink down, NIC on the far socket, no GPU driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterspec import vendors
from clusterspec.vendors import amd_topology, nvidia_topology, topology
from clusterspec.vendors.readings import ToolError
from rlmctl import health, hostcheck
from tests.monitoring.conftest import printing_nvidia

FIXTURES = Path(__file__).parent / "fixtures" / "topology"


def recorded(name: str) -> str:
    """A fixture without its "# source/what" header: exactly what the tool printed."""
    lines = (FIXTURES / name).read_text().splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("# "))


def test_every_fixture_names_its_source() -> None:
    for path in FIXTURES.iterdir():
        assert path.read_text().startswith("# source: "), path.name


def test_dgx_h100_every_pair_nv18() -> None:
    topo = nvidia_topology.parse(recorded("nvidia-smi-topo-dgx-h100.txt"))
    assert topo.gpus == [str(i) for i in range(8)]
    assert len(topo.links) == 28 and set(topo.links.values()) == {"NV18"}
    assert topo.numa["0"] == "0" and topo.numa["7"] == "1"
    assert topology.judge(topo, "NV18", "H100")[0] == "OK"


def test_one_nvlink_down_is_critical_with_the_pair_named() -> None:
    topo = nvidia_topology.parse(recorded("nvidia-smi-topo-dgx-h100-nvlink-down.txt"))
    state, detail, fix = topology.judge(topo, "NV18", "H100")
    assert state == "CRIT"
    assert "1 of 28 GPU pairs below NV18: GPU2-GPU5 SYS" in detail and "drain" in fix


def test_nv6_node_with_a_nic_per_gpu() -> None:
    topo = nvidia_topology.parse(recorded("nvidia-smi-topo-h100-4gpu-nv6.txt"))
    assert set(topo.links.values()) == {"NV6"} and len(topo.nic_paths) == 4
    assert topo.nic_paths["NIC0"] == {"0": "PIX", "1": "SYS", "2": "SYS", "3": "SYS"}
    # A 4-GPU H100 board is not an HGX: against the HGX expectation every pair is short.
    assert topology.judge(topo, "NV18", "H100")[0] == "CRIT"
    assert topology.judge(topo, "NV6", "rlm_gpu_link") == (
        "OK",
        "4 GPUs, 4 NICs, every pair NV6",
        "",
    )


def test_nic_on_the_far_socket_warns_per_gpu() -> None:
    topo = nvidia_topology.parse(recorded("nvidia-smi-topo-8x4090-nic-far-socket.txt"))
    assert topo.nic_paths["NIC1"]["6"] == "PHB"
    assert topology.far_nics(topo)[0] == "GPU0: nearest NIC NIC0 is SYS"
    assert len(topology.far_nics(topo)) == 7  # all but GPU6
    state, detail, _ = topology.judge(topo, "any", None)
    assert state == "WARN" and "far socket" in detail


def test_nic_legend_names_the_nics() -> None:
    text = recorded("nvidia-smi-topo-h100-4gpu-nv6.txt") + "\nNIC Legend:\n\n  NIC0: mlx5_0\n"
    assert "mlx5_0" in nvidia_topology.parse(text).nic_paths


def test_unknown_sku_is_not_judged_but_says_how_to_set_it() -> None:
    topo = nvidia_topology.parse(recorded("nvidia-smi-topo-gb200-4gpu.txt"))
    assert vendors.expected_gpu_link("nvidia", "NVIDIA GB200")[0] == "NV18"
    assert vendors.expected_gpu_link("nvidia", "NVIDIA GeForce RTX 4090") == (None, None)
    state, detail, fix = topology.judge(topo, None, "NVIDIA GeForce RTX 4090")
    assert state == "UNKNOWN" and "RTX 4090" in detail and "rlm_gpu_link" in fix


def test_rocm_smi_pcie_node_fails_an_xgmi_expectation() -> None:
    topo = amd_topology.parse(recorded("rocm-smi-showtopo-4gpu-pcie.txt"))
    assert topo.gpus == ["0", "1", "2", "3"] and set(topo.links.values()) == {"PCIE"}
    assert topo.numa == {"0": "0", "1": "1", "2": "3", "3": "2"}
    assert vendors.expected_gpu_link("amd", "AMD Instinct MI300X")[0] == "XGMI"
    state, detail, _ = topology.judge(topo, "XGMI", "MI300X")
    assert state == "CRIT" and "6 of 6 GPU pairs below XGMI: GPU0-GPU1 PCIE" in detail


def test_mi250x_every_gcd_has_its_three_direct_xgmi_peers() -> None:
    topo = amd_topology.parse(recorded("rocm-smi-showtopo-mi250x-8gcd.txt"))
    assert topo.gpus == [str(i) for i in range(8)] and len(topo.weights) == 28
    assert sorted(set(topo.weights.values())) == [15, 30, 45]
    expected, sku = vendors.expected_gpu_link("amd", "AMD Instinct MI250X/MI250")
    assert (expected, sku) == ("XGMI3", "MI250X")
    assert topology.judge(topo, expected, sku) == (
        "OK",
        "8 GPUs, every pair XGMI, each GPU with 3+ direct xGMI peers",
        "",
    )
    # A layout with 4 direct peers per GCD is not this node's: every GCD is short.
    assert topology.judge(topo, "XGMI4", "rlm_gpu_link")[0] == "CRIT"


def test_mi250x_lost_xgmi_link_is_critical_with_the_gcd_pair_named() -> None:
    topo = amd_topology.parse(recorded("rocm-smi-showtopo-mi250x-8gcd-xgmi-down.txt"))
    state, detail, fix = topology.judge(topo, "XGMI3", "MI250X")
    assert state == "CRIT" and "xGMI" in fix
    assert detail == (
        "1 of 28 GPU pairs below XGMI3: GPU0-GPU2 weight 45, not direct "
        "(GPU0 has 2, GPU2 2 of 3 direct xGMI peers)"
    )
    # The link type alone (what rocm-smi's Hops and Link Type show) cannot see it.
    assert topology.judge(topo, "XGMI", "MI250X")[0] == "OK"


def test_xgmi_peer_count_also_needs_every_pair_xgmi() -> None:
    text = recorded("rocm-smi-showtopo-4gpu-pcie.txt")
    state, detail, _ = topology.judge(amd_topology.parse(text), "XGMI3", "MI250X")
    assert state == "CRIT" and detail.startswith("6 of 6 GPU pairs below XGMI3: GPU0-GPU1 PCIE")


def test_rocm_smi_without_a_gpu_prints_nothing_and_is_a_tool_error() -> None:
    # The real Debian rocm-smi exits 0 with an empty stdout (the fixture holds its stderr).
    assert "Driver not initialized" in recorded("rocm-smi-showtopo-debian-no-gpu.stderr.txt")
    with pytest.raises(ToolError, match="printed nothing"):
        amd_topology.parse("")
    with pytest.raises(ToolError, match="no GPU0 column"):
        nvidia_topology.parse("No devices were found\n")


def test_link_meets() -> None:
    assert topology.link_meets("NV18", "NV18") and topology.link_meets("NV18", "NV12")
    assert not topology.link_meets("NV12", "NV18") and not topology.link_meets("SYS", "NV")
    assert topology.link_meets("XGMI", "xgmi") and topology.link_meets("SYS", "any")


def _tool(bin_dir: Path, name: str, fixture: str | None) -> None:
    """`topo -m` prints the topology recording; a GPU query is answered by the recorded
    stand-in (tests/monitoring/nvidia_smi_standin.py), which names the GPUs H100."""
    script = bin_dir / name
    body = f"cat '{FIXTURES / fixture}' | grep -v '^# '" if fixture else "exit 0"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = topo ]; then {body}; exit; fi\n'
        + printing_nvidia("nvidia-smi-8gpu.csv")
        + "\n"
    )
    script.chmod(0o755)


def test_host_check_runs_the_tool_and_judges_by_sku(tmp_path: Path, monkeypatch) -> None:
    """The check as the gate runs it: nvidia-smi on PATH (a script printing the recordings)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    cfg = {"vendor": "nvidia", "gpus": 8, "thresholds": health.THRESHOLDS}
    _tool(bin_dir, "nvidia-smi", "nvidia-smi-topo-dgx-h100-nvlink-down.txt")
    result = hostcheck.check_topology(cfg)
    assert result["state"] == "CRIT" and "GPU2-GPU5 SYS" in result["detail"], result
    _tool(bin_dir, "nvidia-smi", "nvidia-smi-topo-dgx-h100.txt")
    assert hostcheck.check_topology(cfg)["state"] == "OK"
    # The inventory's rlm_gpu_link overrides the SKU table (here: a stricter, impossible one).
    assert hostcheck.check_topology(cfg | {"gpu_link": "NV24"})["state"] == "CRIT"
    _tool(bin_dir, "nvidia-smi", None)  # the tool prints nothing
    assert hostcheck.check_topology(cfg)["state"] == "UNKNOWN"


def test_topology_is_in_the_shipped_gate(tmp_path: Path) -> None:
    """One round trip: the check travels in the same command line as the others."""
    cfg = {"shared_dir": str(tmp_path), "marker": "m", "token": "t", "gpus": 0, "vendor": "none"}
    cfg |= {"python": sys.executable, "rdzv_port": 0, "thresholds": health.THRESHOLDS}
    out = subprocess.run(
        [sys.executable, "-c", health._script(), json.dumps(cfg)],
        capture_output=True,
        text=True,
        check=True,
    )
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert checks["topology"] == {
        "name": "topology",
        "state": "OK",
        "detail": "skipped (no GPU)",
        "fix": "",
    }


def test_amd_host_check_reads_rocm_smi_only(tmp_path: Path, monkeypatch) -> None:
    """rocm-smi printing the MI250X recording with a lost xGMI link: CRIT naming the GCD pair.
    A host with amd-smi but no rocm-smi is UNKNOWN (amd-smi topology is not parsed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    cfg = {"vendor": "amd", "gpus": 8, "thresholds": health.THRESHOLDS, "gpu_link": "XGMI3"}
    amd_smi = bin_dir / "amd-smi"
    amd_smi.write_text("#!/bin/sh\nexit 0\n")
    amd_smi.chmod(0o755)
    result = hostcheck.check_topology(cfg)
    assert result["state"] == "UNKNOWN" and "rocm-smi not found" in result["detail"], result
    rocm_smi = bin_dir / "rocm-smi"
    fixture = FIXTURES / "rocm-smi-showtopo-mi250x-8gcd-xgmi-down.txt"
    rocm_smi.write_text(f"#!/bin/sh\nexec /bin/grep -v '^# ' '{fixture}'\n")
    rocm_smi.chmod(0o755)
    result = hostcheck.check_topology(cfg)
    assert result["state"] == "CRIT" and "GPU0-GPU2 weight 45" in result["detail"], result

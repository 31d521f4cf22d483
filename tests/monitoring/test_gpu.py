"""Vendor-tool parsers against recorded output, and the runner against stand-in executables."""

from __future__ import annotations

import time

import pytest

from clusterspec.vendors import amd, nvidia
from monitoring import gpu
from tests.monitoring.conftest import FIXTURES, install_tool, printing

MIB = 1024 * 1024
# The nvidia-smi recordings were made with the exporter's field list before `name` and
# `driver_version` were appended; the one parser is told which fields a recording holds.
RECORDED_FIELDS = nvidia.FIELDS[:11]


def read(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_nvidia_smi_eight_gpus() -> None:
    result = nvidia.parse_nvidia_smi(read("nvidia-smi-8gpu.csv"), RECORDED_FIELDS)
    assert result.problems == []
    assert [g.gpu for g in result.gpus] == [str(i) for i in range(8)]
    first, last = result.gpus[0], result.gpus[7]
    assert first.utilization_ratio == pytest.approx(1.0)
    assert first.memory_used_bytes == 74211 * MIB
    assert first.memory_total_bytes == 81559 * MIB
    assert first.temperature_celsius == 63
    assert first.power_watts == pytest.approx(688.21)
    assert first.power_limit_watts == 700
    assert first.power_throttled == 1.0
    assert result.gpus[1].power_throttled == 0.0
    assert (last.ecc_uncorrected_total, last.ecc_corrected_total) == (1, 14)
    assert result.gpus[2].pci_bus == (0, 0x3A, 0)


def test_nvidia_smi_partial_output_keeps_the_readable_gpus() -> None:
    result = nvidia.parse_nvidia_smi(read("nvidia-smi-partial.csv"), RECORDED_FIELDS)
    assert [g.gpu for g in result.gpus] == ["0", "1", "3", "4", "5", "6", "7"]
    assert len(result.problems) == 1 and "Unable to determine" in result.problems[0]
    unknown = result.gpus[3]  # GPU 4 answered [N/A] for several fields
    assert unknown.utilization_ratio is None and unknown.power_watts is None
    assert unknown.temperature_celsius == 64
    assert result.gpus[-1].ecc_uncorrected_total is None  # [Not Supported]


def test_nvidia_smi_garbage_yields_no_gpus() -> None:
    result = nvidia.parse_nvidia_smi("Segmentation fault\n\x00\x01binary,junk\n")
    assert result.gpus == [] and len(result.problems) == 2


def test_amd_smi_eight_gpus() -> None:
    result = amd.parse_amd_smi(read("amd-smi-metric-8gpu.json"))
    assert result.problems == []
    assert len(result.gpus) == 8
    g0, g2, g5 = result.gpus[0], result.gpus[2], result.gpus[5]
    assert g0.utilization_ratio == pytest.approx(0.99)
    assert g0.memory_total_bytes == 196592 * MIB
    assert g0.temperature_celsius == 71  # hotspot; edge is N/A on MI300X
    assert g0.power_watts == 712
    assert g0.power_limit_watts is None  # amd-smi metric does not report the cap
    assert g2.power_throttled == 1.0 and g0.power_throttled == 0.0
    assert (g5.ecc_uncorrected_total, g5.ecc_corrected_total) == (1, 3)


def test_amd_smi_legacy_list_with_unavailable_fields() -> None:
    result = amd.parse_amd_smi(read("amd-smi-metric-legacy-partial.json"))
    assert [g.gpu for g in result.gpus] == ["0", "1"]
    partial = result.gpus[1]
    assert partial.utilization_ratio is None
    assert partial.power_watts == 655  # falls back to average_socket_power
    assert partial.temperature_celsius == 49  # falls back to edge


def test_rocm_smi_cards_and_system_section() -> None:
    result = amd.parse_rocm_smi(read("rocm-smi-showallinfo.json"))
    assert [g.gpu for g in result.gpus] == ["0", "1"]
    card0, card1 = result.gpus
    assert card0.utilization_ratio == pytest.approx(0.94)
    assert card0.temperature_celsius == 52  # junction preferred over edge
    assert card0.power_watts == 412 and card0.power_limit_watts == 560
    assert card0.memory_used_bytes == 60458229760
    assert card1.utilization_ratio is None and card1.power_watts is None


@pytest.mark.parametrize("parser", [amd.parse_amd_smi, amd.parse_rocm_smi])
def test_json_parsers_reject_garbage(parser) -> None:
    with pytest.raises(gpu.ToolError, match="printed no JSON"):
        parser("ERROR: GPU not found\n")


def test_xid_lines_grouped_by_pci_bus() -> None:
    events = gpu.count_xids(read("dmesg-xid.txt"))
    assert {bus: len(lines) for bus, lines in events.items()} == {(0, 0x3A, 0): 1, (0, 0xDB, 0): 2}


def test_run_tool_returns_output_and_exit_code(tool_bin) -> None:
    install_tool(tool_bin, "nvidia-smi", printing("nvidia-smi-partial.csv", exit_code=15))
    output = gpu.run_tool(nvidia.NVIDIA_SMI, timeout_s=10)
    assert output.returncode == 15
    assert output.stdout == read("nvidia-smi-partial.csv")


def test_run_tool_kills_a_hanging_tool(tool_bin) -> None:
    install_tool(tool_bin, "amd-smi", "sleep 300 &\nwait")
    started = time.monotonic()
    with pytest.raises(gpu.ToolError, match=r"did not finish within 0\.5 s"):
        gpu.run_tool(amd.AMD_SMI, timeout_s=0.5)
    assert time.monotonic() - started < 10


def test_run_tool_missing_binary(tool_bin, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tool_bin))
    with pytest.raises(gpu.ToolError, match="cannot run rocm-smi"):
        gpu.run_tool(amd.ROCM_SMI, timeout_s=1)
    assert gpu.detect_source() is None


def test_detect_source_prefers_nvidia_then_amd_smi(tool_bin, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tool_bin))
    install_tool(tool_bin, "rocm-smi", "true")
    assert gpu.detect_source() == "rocm-smi"
    install_tool(tool_bin, "amd-smi", "true")
    assert gpu.detect_source() == "amd-smi"

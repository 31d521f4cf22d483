"""Vendor-tool parsers against recorded output, and the runner against stand-in executables."""

from __future__ import annotations

import ast
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from clusterspec.vendors import amd, nvidia
from monitoring import gpu
from tests.monitoring.conftest import (
    FIXTURES,
    RECORDED_FIELDS,
    install_tool,
    printing,
    printing_nvidia,
)

MIB = 1024 * 1024


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
    # At its power cap under full load (688 W of 700 W): a reason, not a fault.
    assert first.clock_events == {
        "sw_power_cap": 1.0,
        "hw_slowdown": 0.0,
        "hw_thermal_slowdown": 0.0,
        "hw_power_brake_slowdown": 0.0,
        "sw_thermal_slowdown": 0.0,
    }
    assert result.gpus[1].clock_events["sw_power_cap"] == 0.0
    assert first.memory_temperature_celsius == 70
    assert (first.row_remap_pending, first.row_remap_failed) == (0.0, 0.0)
    assert (last.ecc_uncorrected_total, last.ecc_corrected_total) == (1, 14)
    assert (last.row_remap_pending, last.row_remap_failed) == (1.0, 0.0)  # after its DBE
    assert result.gpus[2].pci_bus == (0, 0x3A, 0)


def test_nvidia_smi_partial_output_keeps_the_readable_gpus() -> None:
    result = nvidia.parse_nvidia_smi(read("nvidia-smi-partial.csv"), RECORDED_FIELDS)
    assert [g.gpu for g in result.gpus] == ["0", "1", "3", "4", "5", "6", "7"]
    assert len(result.problems) == 1 and "Unable to determine" in result.problems[0]
    unknown = result.gpus[3]  # GPU 4 answered [N/A] for several fields
    assert unknown.utilization_ratio is None and unknown.power_watts is None
    assert unknown.temperature_celsius == 64
    assert unknown.clock_events == {} and unknown.memory_temperature_celsius is None
    last = result.gpus[-1]
    assert last.ecc_uncorrected_total is None and last.row_remap_pending is None  # [Not Supported]
    slowed = result.gpus[4]  # GPU 5: hardware thermal slowdown
    assert slowed.clock_events["hw_slowdown"] == slowed.clock_events["hw_thermal_slowdown"] == 1


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
    assert g0.memory_temperature_celsius == 58
    assert g0.pcie_replays_total == 0
    # ROCm 6.2+ violation statuses: package power (ppt) is the power cap; HBM thermal is thermal.
    assert g0.clock_events == {"sw_power_cap": 1.0, "hw_thermal_slowdown": 0.0, "hw_slowdown": 0.0}
    assert result.gpus[6].clock_events["hw_thermal_slowdown"] == 1.0
    assert g2.clock_events == {"sw_power_cap": 1.0}  # older: power.throttle_status only
    assert result.gpus[1].clock_events == {"sw_power_cap": 0.0}
    assert result.gpus[3].interconnect_errors == {
        ("xgmi", "correctable_errors"): 12,
        ("xgmi", "uncorrectable_errors"): 0,
    }
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
    assert card0.memory_temperature_celsius == 48 and card0.pcie_replays_total == 2
    assert card1.utilization_ratio is None and card1.power_watts is None


@pytest.mark.parametrize("parser", [amd.parse_amd_smi, amd.parse_rocm_smi])
def test_json_parsers_reject_garbage(parser) -> None:
    with pytest.raises(gpu.ToolError, match="printed no JSON"):
        parser("ERROR: GPU not found\n")


def test_xid_events_grouped_by_pci_bus_with_codes() -> None:
    events = nvidia.xid_events(read("dmesg-xid.txt"))
    codes = {bus: [code for code, _ in found] for bus, found in events.items()}
    assert codes == {(0, 0x3A, 0): [79], (0, 0xDB, 0): [48, 63]}


def test_grouped_query_keeps_the_other_groups_when_one_field_is_rejected(tool_bin) -> None:
    # An older driver that knows only clocks_throttle_reasons.*: that group fails, nothing else.
    install_tool(
        tool_bin,
        "nvidia-smi",
        printing_nvidia("nvidia-smi-8gpu.csv", reject=("clocks_event_reasons.hw_slowdown",)),
    )
    output = gpu.run_tool(nvidia.NVIDIA_SMI, timeout_s=30, name="nvidia-smi")
    assert output.returncode == 0
    result = nvidia.parse_nvidia_smi(output.stdout)
    assert [g.gpu for g in result.gpus] == [str(i) for i in range(8)]
    assert result.problems == [
        "nvidia-smi rejected " + ",".join(nvidia.CLOCK_EVENT_FIELDS) + " (exit 2): "
        'Field "clocks_event_reasons.hw_slowdown" is not a valid field to query.'
    ]
    first = result.gpus[0]
    assert first.clock_events == {}  # only the rejected group's fields are missing
    assert first.memory_temperature_celsius == 70
    assert first.temperature_celsius == 63 and first.ecc_corrected_total == 0
    assert first.uuid == "GPU-5b0e3c1a-9f1d-4c2b-8e7a-000000000000"
    assert first.serial == "1650423010000" and first.name == "NVIDIA H100 80GB HBM3"


def test_grouped_query_with_a_gpu_off_the_bus(tool_bin) -> None:
    install_tool(tool_bin, "nvidia-smi", printing_nvidia("nvidia-smi-partial.csv", exit_code=15))
    output = gpu.run_tool(nvidia.NVIDIA_SMI, timeout_s=30, name="nvidia-smi")
    assert output.returncode == 15  # the first group's status: the health gate sees the failure
    result = nvidia.parse_nvidia_smi(output.stdout)
    assert [g.gpu for g in result.gpus] == ["0", "1", "3", "4", "5", "6", "7"]
    assert result.problems and all("Unable to determine" in p for p in result.problems)
    assert result.gpus[0].clock_events["sw_power_cap"] == 1.0  # clocks_event_reasons answered


def test_pcie_replays_from_the_full_query_by_pci_address() -> None:
    replays, problems = nvidia.parse_pcie_replays(read("nvidia-smi-q-8gpu.txt"))
    assert problems == []
    assert len(replays) == 8
    assert replays[(0, 0x3A, 0)] == 12 and replays[(0, 0xDB, 0)] == 3 and replays[(0, 0x18, 0)] == 0


def test_nvlink_error_counters_per_gpu_link_and_counter() -> None:
    errors, problems = nvidia.parse_nvlink_errors(read("nvidia-smi-nvlink-e-8gpu.txt"))
    assert problems == []
    gpu2 = errors["GPU-5b0e3c1a-9f1d-4c2b-8e7a-000000000002"]
    assert len(errors) == 8 and len(gpu2) == 18 * 3
    assert gpu2[("5", "crc_errors")] == 37 and gpu2[("5", "replay_errors")] == 4
    assert gpu2[("5", "recovery_errors")] == 0


def test_link_counters_command_runs_both_parts_and_keeps_one_that_works(tool_bin) -> None:
    """A PCIe card without NVLink: `nvidia-smi nvlink -e` fails, the replays still count."""
    install_tool(
        tool_bin,
        "nvidia-smi",
        f'if [ "$1" = nvlink ]; then echo "NVLink is not supported"; exit 3; fi\n'
        f"cat '{FIXTURES / 'nvidia-smi-q-8gpu.txt'}'",
    )
    command, parse = gpu.COUNTERS["nvidia-smi"]
    counters = parse(gpu.run_tool(command, timeout_s=30).stdout)
    assert counters.pcie_replays[(0, 0x3A, 0)] == 12
    assert counters.interconnect_errors == {}
    assert counters.problems == ["nvidia-smi nvlink exited 3: NVLink is not supported"]


def test_query_uses_the_current_clock_event_field_names() -> None:
    assert "clocks_event_reasons.sw_power_cap" in nvidia.FIELDS
    assert not any(field.startswith("clocks_throttle_reasons") for field in nvidia.FIELDS)
    assert all(group[0] == "index" for group in nvidia.QUERY_GROUPS)


ROCM_SMI_SOURCE = Path("/usr/libexec/rocm_smi/rocm_smi.py")  # Debian package rocm-smi


def rocm_smi_printable_keys(source: str) -> set[str]:
    """Every key rocm-smi 5.x can print: its string constants, its '%s' formats expanded with
    its name lists (memory types, temperature sensors, components) and `name + ' version'`."""
    tree = ast.parse(source)
    constants = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    names = {
        element.value
        for node in ast.walk(tree)
        if isinstance(node, ast.List | ast.Dict)
        for element in (node.elts if isinstance(node, ast.List) else node.values)
        if isinstance(element, ast.Constant) and isinstance(element.value, str)
    }
    formats = {c for c in constants if c.count("%s") == 1 and c.count("%") == 1}
    suffixes = {c for c in constants if c.startswith(" ")}
    return (
        constants
        | {f % name for f in formats for name in names}
        | {name + suffix for name in names for suffix in suffixes}
    )


@pytest.mark.skipif(not ROCM_SMI_SOURCE.exists(), reason="needs Debian's rocm-smi package")
def test_every_rocm_smi_key_and_flag_exists_in_the_real_tool() -> None:
    printable = rocm_smi_printable_keys(ROCM_SMI_SOURCE.read_text())
    assert set(amd.ROCM_SMI_KEYS.values()) - printable == set()
    live_help = subprocess.run(
        ["rocm-smi", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    recorded_help = read("rocm-smi-5.2.3-help.txt")
    for flag in (arg for arg in amd.ROCM_SMI[1:] if arg.startswith("--")):
        assert flag in live_help and flag in recorded_help, flag


def test_real_rocm_smi_without_a_gpu_is_a_tool_error() -> None:
    # Recorded from Debian's rocm-smi 5.2.3 on a machine without an AMD GPU (fixtures/README.md):
    # exit status 0, an empty stdout and the reason on stderr.
    assert read("rocm-smi-5.2.3-no-gpu.stdout") == ""
    assert "Driver not initialized" in read("rocm-smi-5.2.3-no-gpu.stderr")
    with pytest.raises(gpu.ToolError, match="printed no JSON"):
        amd.parse_rocm_smi(read("rocm-smi-5.2.3-no-gpu.stdout"))


@pytest.mark.skipif(not shutil.which("rocm-smi"), reason="needs Debian's rocm-smi package")
def test_real_rocm_smi_runs_here_like_the_recording() -> None:
    output = gpu.run_tool(amd.ROCM_SMI, timeout_s=60)
    assert (output.returncode, output.stdout) == (0, read("rocm-smi-5.2.3-no-gpu.stdout"))


def test_run_tool_kills_and_reaps_a_tool_whose_child_left_its_session(tool_bin) -> None:
    # The child holds the pipes open from another session: waiting for EOF would take 300 s.
    pid_file = tool_bin / "child.pid"
    install_tool(
        tool_bin, "amd-smi", f"setsid sh -c 'echo $$ > {pid_file}; exec sleep 300' &\nwait"
    )
    started = time.monotonic()
    with pytest.raises(gpu.ToolError, match=r"did not finish within 1 s"):
        gpu.run_tool(amd.AMD_SMI, timeout_s=1)
    assert time.monotonic() - started < 3
    child = int(pid_file.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_run_tool_returns_output_and_exit_code(tool_bin) -> None:
    install_tool(tool_bin, "nvidia-smi", printing("nvidia-smi-partial.csv", exit_code=15))
    output = gpu.run_tool(("nvidia-smi",), timeout_s=10)
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

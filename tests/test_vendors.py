"""The GPU vendor descriptions (clusterspec/vendors): complete, stdlib-only, runnable by a host's
Python 3.8, and the only source of vendor facts for the gate, the exporter and the trainer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from clusterspec import vendors
from clusterspec.variables import variables

REPO = Path(__file__).resolve().parents[1]
REQUIRED = (
    "NAME",
    "TORCH_DEVICE",
    "DIST_BACKEND",
    "BANDWIDTH_TEST",
    "EXPORTER_JOB",
    "TOOLS",
    "PARSERS",
    "KERNEL_LOG",
    "XID_CRITICAL",
    "XID_WARNING",
    "PEAK_BF16_FLOPS",
    "BUSBW_FLOORS_GBPS",
    "xid_events",
    "judge_xids",
)


@pytest.mark.parametrize("name", sorted(vendors.VENDORS))
def test_each_vendor_describes_everything(name: str) -> None:
    module = vendors.VENDORS[name]
    assert [attr for attr in REQUIRED if not hasattr(module, attr)] == []
    assert name == module.NAME
    assert set(module.TOOLS) == set(module.PARSERS)  # one parser per tool output
    assert module.PEAK_BF16_FLOPS and all(v > 1e12 for v in module.PEAK_BF16_FLOPS.values())


def test_the_inventory_knows_every_vendor() -> None:
    assert set(variables()["rlm_gpu_vendor"].choices) == {*vendors.VENDORS, "auto", "none"}


def test_shipped_code_parses_as_python_3_8() -> None:
    shipped = [*sorted((REPO / "clusterspec/vendors").glob("*.py")), REPO / "rlmctl/hostcheck.py"]
    for path in shipped:
        ast.parse(path.read_text(encoding="utf-8"), str(path), feature_version=(3, 8))


def test_vendor_descriptions_need_only_the_standard_library() -> None:
    code = (
        "import sys, clusterspec.vendors, rlmctl.hostcheck; "
        "print(sorted(m for m in ('torch', 'yaml', 'numpy', 'typer') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_vendor_table_outside_the_descriptions() -> None:
    """Peak FLOP/s and bandwidth floors are looked up, never re-tabulated."""
    tables = []
    for path in [
        *REPO.glob("rlmctl/*.py"),
        *REPO.glob("monitoring/*.py"),
        *REPO.glob("trainer/*.py"),
    ]:
        text = path.read_text(encoding="utf-8")
        for marker in ('"MI300X":', '"H100":', "XID_CRITICAL ="):
            if marker in text:
                tables.append(f"{path.relative_to(REPO)}: {marker}")
    assert tables == []


def _role_facts() -> dict[str, dict]:
    sys.path.insert(0, str(REPO / "plugins" / "lookup"))
    try:
        import rlm_vendor
    finally:
        sys.path.pop(0)
    return {name: rlm_vendor.vendor_facts(name) for name in vendors.VENDORS}


def test_the_roles_read_vendor_facts_from_the_descriptions() -> None:
    """Every fact the rlm_vendor lookup hands the roles exists, and no role or playbook repeats
    one outside the vendor's own role (PCI id, device node, torch index, bandwidth-test source,
    exporter package, power tool)."""
    facts = _role_facts()
    repeated = []
    texts = {
        path: path.read_text(encoding="utf-8")
        for pattern in ("roles/**/*.yml", "roles/**/*.j2", "playbooks/*.yml")
        for path in REPO.glob(pattern)
    }
    for name, fact in facts.items():
        values = [
            f'"{fact["pci_vendor_id"]}"',
            fact["device_files"]["control"],
            fact["torch_index_url"],
            *fact["bandwidth_test_source"],
            *fact["exporter_packages"],
            fact["power_query"][0] + " ",
        ]
        for path, text in texts.items():
            if path.is_relative_to(REPO / "roles" / f"gpu_{name}") or path.parent.name == "meta":
                continue  # the vendor's own role; role documentation
            lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
            repeated += [
                f"{path.relative_to(REPO)}: {value}"
                for value in values
                if any(value in line for line in lines)
            ]
    assert repeated == [], repeated


def test_every_vendor_names_its_slurm_gres_device_files() -> None:
    """gres.conf's File= of every described vendor: the slurm role has no table of its own in
    which a new vendor could be missing (and its nodes get no GPUs)."""
    files = {name: fact["gres_files"] for name, fact in _role_facts().items()}
    assert files == {
        "nvidia": {"prefix": "/dev/nvidia", "first": 0},
        "amd": {"prefix": "/dev/dri/renderD", "first": 128},
    }
    defaults = (REPO / "roles/slurm/defaults/main.yml").read_text(encoding="utf-8")
    assert "slurm_gres_files: \"{{ lookup('rlm_vendor', attribute='gres_files') }}\"" in defaults


NVIDIA_POWER = (
    # nvidia-smi --query-gpu=index,power.min_limit,power.max_limit,power.limit,
    # power.default_limit,persistence_mode --format=csv,noheader,nounits (H100 SXM, driver 550)
    "0, 200.00, 700.00, 700.00, 700.00, Enabled\n1, 200.00, 700.00, 550.00, 700.00, Disabled\n"
)


def test_nvidia_power_limits_parse() -> None:
    gpus = vendors.nvidia.parse_power_limits(NVIDIA_POWER)
    assert gpus[1] == {
        "index": 1,
        "min": 200.0,
        "max": 700.0,
        "current": 550.0,
        "default": 700.0,
        "persistence": "Disabled",
    }
    with pytest.raises(ValueError, match="unreadable nvidia-smi power line"):
        vendors.nvidia.parse_power_limits("0, 200.00, [N/A]\n")


@pytest.mark.parametrize(
    "text",
    [
        # ROCm 6.2: a list, values as {value, unit}
        '[{"gpu": 0, "limit": {"max_power": {"value": 750, "unit": "W"},'
        ' "min_power": {"value": 0, "unit": "W"}, "socket_power": {"value": 600, "unit": "W"}}}]',
        # ROCm 6.3+: {"gpu_data": [...]}
        '{"gpu_data": [{"gpu": 0, "limit": {"max_power": {"value": 750, "unit": "W"},'
        ' "min_power": {"value": 0, "unit": "W"}, "socket_power": {"value": 600, "unit": "W"}}}]}',
        # older releases: "750 W" strings
        '[{"gpu": 0, "limit": {"max_power": "750 W", "min_power": "0 W", "socket_power": "600.0 W"}}]',
    ],
)
def test_amd_power_limits_parse_every_amd_smi_shape(text: str) -> None:
    assert vendors.amd.parse_power_limits(text) == [
        {
            "index": 0,
            "min": 0.0,
            "max": 750.0,
            "current": 600.0,
            "default": 750.0,
            "persistence": "N/A",
        }
    ]

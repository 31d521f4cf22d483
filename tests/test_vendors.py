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

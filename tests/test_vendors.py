"""The GPU vendor descriptions (clusterspec/vendors): complete, stdlib-only, runnable by a host's
Python 3.8, and the only source of vendor facts for the gate, the exporter and the trainer."""

from __future__ import annotations

import ast
import re
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
    assert (
        "slurm_gres_files: \"{{ lookup('rlm.ops.rlm_vendor', attribute='gres_files') }}\""
        in defaults
    )


# Where a vendor may be named: its description, its role, documentation and tests (bench/ runs
# on the tests' stand-ins and fixtures). Role metadata is documentation, except the choices an
# argument spec validates.
VENDOR_PLACES = (
    "clusterspec/vendors/",
    "docs/",
    "tests/",
    "bench/",
    "monitoring/prometheus/tests/",
)
# Every other file that names a vendor or one of its tools today, and why. Each is listed in
# docs/architecture.md, "A new GPU vendor": the file count there is this list's plus the
# description's, the role's, the docs' and the tests'.
NAMES_A_VENDOR = {
    "clusterspec/variables.yml": "rlm_gpu_vendor's choices (the inventory's spec)",
    "inventory/example/hosts.yml": "the example inventory's group per vendor",
    "inventory/example/group_vars/compute_amd.yml": "the example group's settings",
    "inventory/example/group_vars/compute_nvidia.yml": "the example group's settings",
    "playbooks/provision.yml": "the gpu_<vendor> role in the GPU play",
    "roles/rlm_exporter/meta/argument_specs.yml": "the GPU tools rlm_exporter_gpu_source takes",
    "roles/trainer_env/tasks/verify.yml": "which torch.version field a vendor's build sets",
    "rlmctl/deep.py": "the GPU model query of `health --deep` (a shell one-liner per vendor)",
    "rlmctl/wheelhouse.py": "--vendor's help text",
    "trainer/distributed.py": "which description a torch build is (torch.version.hip)",
    "monitoring/exporter.py": "the GPU source metric's help text; XID events (NVIDIA only)",
    "roles/gpu_detect/tasks/detect.yml": "NVSwitch detection (NVIDIA only)",
    "roles/gpu_exporter/defaults/main.yml": "dcgm-exporter's collectors (NVIDIA only)",
    "roles/gpu_exporter/tasks/main.yml": "dcgm-exporter's collectors (NVIDIA only)",
    "Makefile": "the real rocm-smi, a test package (it runs without a GPU)",
}


def _vendor_words() -> re.Pattern[str]:
    words = set(vendors.VENDORS)
    for vendor in vendors.VENDORS.values():
        words |= {*vendor.TOOLS, vendor.TOPOLOGY.COMMAND[0], vendor.NAME_QUERY[0]}
        words |= {vendor.POWER_QUERY[0], vendor.POWER_SET[0]}
    alternatives = "|".join(sorted(map(re.escape, words), key=len, reverse=True))
    return re.compile(rf"(?<![A-Za-z0-9-])({alternatives})(?![A-Za-z0-9-])", re.IGNORECASE)


def _code_strings(path: Path, text: str) -> list[tuple[int, str]]:
    """(line, text) of what runs or configures: Python's names and non-docstring strings, other
    files' lines without comments; of a role's metadata only what its argument specs validate."""
    if path.suffix == ".py":
        tree = ast.parse(text)
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        out = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) not in docstrings:
                    out.append((node.lineno, node.value))
            elif isinstance(node, ast.Name | ast.Attribute | ast.alias):
                word = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
                out.append((getattr(node, "lineno", 0), word or getattr(node, "name", "")))
        return out
    lines = list(enumerate(text.splitlines(), 1))
    if path.parent.name == "meta":
        return [(n, line) for n, line in lines if line.lstrip().startswith("choices:")]
    return [(n, line) for n, line in lines if not line.lstrip().startswith("#")]


def test_no_vendor_is_named_outside_its_description_role_docs_and_tests() -> None:
    """A vendor name or tool anywhere else is a file a new vendor must find and edit: each such
    file is known and counted in docs/architecture.md, and a new one fails here."""
    words = _vendor_words()
    roles = tuple(f"roles/gpu_{name}/" for name in vendors.VENDORS)
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    found: dict[str, list[str]] = {}
    for name in tracked:
        path = REPO / name
        if name.startswith(VENDOR_PLACES + roles) or path.suffix == ".md" or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary fixtures
        for line, code in _code_strings(path, text):
            for match in words.finditer(code):
                found.setdefault(name, []).append(f"{line}: {match.group(0)}")
    unexpected = {name: hits for name, hits in found.items() if name not in NAMES_A_VENDOR}
    assert unexpected == {}, "name the vendor only in its description (clusterspec/vendors)"
    assert sorted(set(NAMES_A_VENDOR) - set(found)) == [], "no longer names a vendor: unlist it"
    section = (REPO / "docs/architecture.md").read_text(encoding="utf-8")
    section = section.split("## A new GPU vendor", 1)[1].split("\n## ", 1)[0]
    assert [name for name in NAMES_A_VENDOR if f"`{name}`" not in section] == []


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

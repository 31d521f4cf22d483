"""The import graph of the tree: the run contract at the bottom, no cycles, no forbidden arrow.

Every import statement counts, also those inside functions and under `if TYPE_CHECKING:` (an
import hidden in a function is still an arrow, and a cycle hidden that way is still a cycle).
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("runcontract", "clusterspec", "rlmctl", "monitoring", "trainer")
CONTRACT_MAY_IMPORT = {"yaml"}  # besides the standard library and itself
HEAVY = ("torch", "numpy", "ansible")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def imports(path: Path, known: set[str]) -> set[str]:
    """Every module `path` imports: in-tree modules by their full name (`from pkg import mod`
    names the module), third-party and standard modules by their top-level name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path).rpartition(".")[0] if path.name != "__init__.py" else ""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name if alias.name in known else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                child = f"{base}.{alias.name}"
                if child in known:
                    found.add(child)
                elif base in known:
                    found.add(base)
                else:
                    found.add(base.split(".")[0])
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    names = set(known)
    # A package's __init__ is imported with each of its modules: not an arrow of its own.
    return {name: imports(path, names) - {name} for name, path in known.items()}


def in_tree(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(t for t in edges.get(node, ()) if t in edges):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def reaches(edges: dict[str, set[str]], start: str, targets: tuple[str, ...]) -> list[str] | None:
    """A path of imports from `start` to one of `targets` (top-level names), or None."""
    seen = {start}
    paths = [[start]]
    while paths:
        path = paths.pop(0)
        for target in sorted(edges.get(path[-1], ())):
            if target.split(".")[0] in targets:
                return [*path, target]
            if target in edges and target not in seen:
                seen.add(target)
                paths.append([*path, target])
    return None


def test_the_tree_has_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_the_contract_imports_only_the_standard_library_and_yaml() -> None:
    stdlib = set(sys.stdlib_module_names)
    wrong = {
        f"{name} imports {target}"
        for name, targets in graph().items()
        if name.startswith("runcontract")
        for target in targets
        if not target.startswith("runcontract")
        and target.split(".")[0] not in stdlib | CONTRACT_MAY_IMPORT
    }
    assert sorted(wrong) == []


@pytest.mark.parametrize(
    ("source", "forbidden"),
    [
        ("rlmctl", "trainer"),  # the trainer's side is torch: rlmctl reads the contract only
        ("monitoring", "rlmctl"),
        ("clusterspec", "rlmctl"),
        ("clusterspec", "trainer"),
        ("clusterspec", "monitoring"),
        ("runcontract", "clusterspec"),
    ],
)
def test_no_forbidden_arrow(source: str, forbidden: str) -> None:
    arrows = [
        f"{name} -> {target}"
        for name, targets in graph().items()
        if name.split(".")[0] == source
        for target in targets
        if target.split(".")[0] == forbidden
    ]
    assert arrows == []


@pytest.mark.parametrize("package", ["runcontract", "clusterspec", "rlmctl", "monitoring"])
def test_no_path_of_imports_leads_to_torch(package: str) -> None:
    edges = graph()
    paths = [
        " -> ".join(path)
        for name in sorted(edges)
        if name.split(".")[0] == package
        if (path := reaches(edges, name, ("torch", "numpy")))
    ]
    assert paths == []


def test_importing_the_contract_loads_no_heavy_module() -> None:
    """The same from the interpreter's side: every contract module imported, none of torch,
    numpy or ansible is in sys.modules afterwards."""
    names = sorted(n for n in modules() if n.startswith("runcontract"))
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == "[]"


# Files of other streams that still name states and events by string (trainer: train.py,
# metrics.py; monitoring: exporter.py; bench/exporter.py), ported at their merge.
LITERALS_PENDING = {"trainer", "bench", "monitoring/exporter.py"}


def test_no_run_state_or_event_kind_is_a_string_literal() -> None:
    """States and event kinds are runcontract.states members everywhere (`RunState.DONE`, not
    "done"): a run-state name as a string anywhere, an event kind compared as a string."""
    from runcontract.states import EventKind, RunState

    states = {s.value for s in RunState}
    kinds = {k.value for k in EventKind}
    found = []
    for name, path in modules().items():
        relative = path.relative_to(REPO).as_posix()
        if name.startswith("runcontract") or relative.split("/")[0] in LITERALS_PENDING:
            continue
        if relative in LITERALS_PENDING:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in states:
                found.append(f"{relative}:{node.lineno}: {node.value!r}")
            if isinstance(node, ast.Compare):
                for operand in [node.left, *node.comparators]:
                    if isinstance(operand, ast.Constant) and operand.value in kinds:
                        found.append(f"{relative}:{node.lineno}: {operand.value!r}")
    assert found == []


# -- every directly imported package is declared, on the side that imports it ------------------
# trainer/hub/ is the remote code `trainer export` writes beside a model: transformers imports it
# there (the dev extra has transformers for the tests that load exports), the trainer never does.
NOT_IMPORTED_BY_US = ("trainer/hub/",)
# Imported where installed, with a fallback without it: rlmctl/charts.py draws SVG itself.
OPTIONAL = {"matplotlib"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, set[str]]:
    """Distribution names per install: "" (the base), then each extra."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    return {
        group: {normalized(re.match(r"[A-Za-z0-9._-]+", r)[0]) for r in requirements}  # type: ignore[index]
        for group, requirements in groups.items()
    }


def third_party(names: set[str]) -> set[str]:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    return {n.split(".")[0] for n in names if not in_tree(n) and n.split(".")[0] not in stdlib}


@functools.cache
def distributions(module: str) -> frozenset[str]:
    """The installed distributions that provide a top-level module (`yaml` -> pyyaml)."""
    import importlib.metadata

    found = importlib.metadata.packages_distributions().get(module, [])
    return frozenset(normalized(d) for d in found)


def closure(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every in-tree module `start` reaches through its imports, itself included."""
    seen, todo = {start}, [start]
    while todo:
        for target in edges.get(todo.pop(), ()):
            if target in edges and target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def undeclared(modules: set[str], allowed: set[str], edges: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{name} imports {package}"
        for name in modules
        for package in third_party(edges[name])
        if package not in OPTIONAL and not distributions(package) & allowed
    )


def test_every_directly_imported_package_is_declared() -> None:
    """Once rich (rlmctl's tables) was imported and installed only as typer's dependency."""
    edges = graph()
    groups = declared()
    ours = {
        name
        for name, path in modules().items()
        if not path.relative_to(REPO).as_posix().startswith(NOT_IMPORTED_BY_US)
    }
    everything = groups[""] | groups["controller"] | groups["train"]
    assert undeclared(ours, everything, edges) == []


@pytest.mark.parametrize(
    ("entry", "installs"),
    [
        ("monitoring.exporter", ("",)),  # an exporter-only host: `pip install rlm-ops`
        ("rlmctl.cli", ("", "controller")),
        ("monitoring.credentials", ("", "controller")),  # run on the controller by the roles
        ("monitoring.file_sd", ("", "controller")),
        ("trainer.cli", ("", "train")),
    ],
)
def test_each_entry_point_imports_only_its_installs_packages(
    entry: str, installs: tuple[str, ...]
) -> None:
    edges = graph()
    groups = declared()
    allowed = set().union(*(groups[g] for g in installs))
    assert undeclared(closure(edges, entry), allowed, edges) == []

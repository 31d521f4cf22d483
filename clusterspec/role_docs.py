"""The roles' documentation, generated from the two files that define each role variable.

A role variable's type, choices and description live in `roles/<role>/meta/argument_specs.yml`,
its value in `roles/<role>/defaults/main.yml`; a site-level `rlm_*` variable lives in
`clusterspec/variables.yml`. From those, `python -m clusterspec.role_docs` writes:

- the `default:` of every option in each argument spec (what `ansible-doc -t role` shows): the
  value in defaults/main.yml, with `{{ rlm_x | default(lookup('rlm.ops.rlm_default', 'rlm_x')) }}`
  replaced by rlm_x's default (the value a site that does not set rlm_x gets);
- `roles/<role>/README.md`;
- the end of `inventory/example/group_vars/all.yml`: every rlm_* variable the example does not
  set above, commented out at its default, with its one description.

tests/test_role_docs.py fails when a checked-in file differs from what this writes.
`--check` says which files would change and exits 1, writing nothing.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml

from clusterspec.variables import Variable, variables

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = Path("inventory/example/group_vars/all.yml")
EXAMPLE_MARKER = "# --- Every other rlm_* variable, at its default "
# The one way a role defaults to a site variable (tests/test_clusterspec.py enforces it).
SITE_DEFAULT = re.compile(
    r"\{\{ (rlm_\w+) \| default\(lookup\('rlm\.ops\.rlm_default', '\1'\)\) \}\}"
)
# Keys of an option in the order they are written; `default` is the generated one.
OPTION_KEYS = ("type", "elements", "choices", "required", "no_log", "default", "description")


def _site_default(value: Any) -> tuple[Any, list[str]]:
    """The value a role default takes when the site sets none of the rlm_* variables it reads,
    and those variables; a value with other templating is returned as written."""
    if not isinstance(value, str):
        return value, []
    if "{{" in value:  # a folded template's line breaks are layout, not content
        value = " ".join(value.split())
    spec = variables()
    whole = SITE_DEFAULT.fullmatch(value.strip())
    if whole and whole.group(1) in spec:
        return spec[whole.group(1)].default, [whole.group(1)]
    names = [m.group(1) for m in SITE_DEFAULT.finditer(value) if m.group(1) in spec]
    if not names:
        return value, []
    text = SITE_DEFAULT.sub(lambda m: str(spec[m.group(1)].default), value)
    return (text if "{{" not in text else value), names


def _option_default(name: str, defaults: dict[str, Any]) -> tuple[bool, Any, list[str]]:
    """(has a default, the default, the rlm_* variables it comes from) of one role option."""
    if name in defaults:
        value, names = _site_default(defaults[name])
        return True, value, names
    spec = variables()
    if name in spec:  # a site variable the role reads directly (rlm_exporter_port)
        return True, spec[name].default, [name]
    return False, None, []


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def roles(root: Path = ROOT) -> list[Path]:
    return sorted(
        p for p in (root / "roles").iterdir() if (p / "meta/argument_specs.yml").is_file()
    )


def argument_specs(role: Path) -> dict[str, Any]:
    """The role's argument spec with every option's default filled in from defaults/main.yml."""
    defaults = _load(role / "defaults/main.yml") or {}
    specs = _load(role / "meta/argument_specs.yml")["argument_specs"]
    out: dict[str, Any] = {}
    done: dict[int, dict[str, Any]] = {}
    for entry_name, entry in specs.items():
        if id(entry) in done:  # an entry point sharing another's options (comm's verify)
            out[entry_name] = done[id(entry)]
            continue
        options = {}
        for name, option in entry.get("options", {}).items():
            has, value, _ = _option_default(name, defaults)
            fields = {k: option[k] for k in OPTION_KEYS if k in option and k != "default"}
            if has and not option.get("required"):
                fields["default"] = value
            unknown = set(option) - set(OPTION_KEYS)
            if unknown:
                raise ValueError(f"{role.name}: {name}: unsupported keys {sorted(unknown)}")
            options[name] = {k: fields[k] for k in OPTION_KEYS if k in fields}
        head = {k: v for k, v in entry.items() if k != "options"}
        out[entry_name] = done[id(entry)] = {**head, "options": options}
    return {"argument_specs": out}


class _Dumper(yaml.SafeDumper):
    """Block style, entry points shared by anchor under a readable name, lists of scalars inline."""

    anchor_name = "options"

    def generate_anchor(self, node: yaml.Node) -> str:
        return self.anchor_name

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)  # yamllint wants sequences indented under their key


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    # Inline when short: a wrapped flow sequence is indented in a way yamllint refuses.
    flow = all(not isinstance(item, dict | list) for item in data) and len(str(data)) < 60
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    # Long values folded (`>-`), short templates double-quoted: their own quotes stay as written.
    style = ">" if len(data) > 72 else '"' if "'" in data and '"' not in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(str, _represent_str)


def argument_specs_yaml(role: Path) -> str:
    dumper = type("_RoleDumper", (_Dumper,), {"anchor_name": f"{role.name}_options"})
    header = (
        "# Type, choices and description: edit here. `default:` is generated from defaults/main.yml\n"
        "# (and clusterspec/variables.yml) by `python -m clusterspec.role_docs`, which also writes\n"
        "# README.md; tests/test_role_docs.py fails when they drift.\n"
    )
    body = yaml.dump(
        argument_specs(role), Dumper=dumper, sort_keys=False, width=72, allow_unicode=True
    )
    return header + body


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _shown(value: Any) -> str:
    if isinstance(value, str) and value and value.strip() == value and "\n" not in value:
        return value
    flat = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip()
    return flat.removesuffix("\n...").removesuffix("...").strip()


def _default_cell(name: str, defaults: dict[str, Any]) -> str:
    has, value, names = _option_default(name, defaults)
    if not has:
        return "none"
    shown = f"`{_cell(_shown(value))}`"
    if names:
        shown += " from " + ", ".join(f"`{n}`" for n in names)
    return shown


def _about(role: Path) -> str:
    """The opening comment of defaults/main.yml: what the role does, in its author's words."""
    head = []
    for line in (role / "defaults/main.yml").read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        head.append(line.removeprefix("#").strip())
    text = " ".join(head).removeprefix(f"{role.name}:").strip()
    return text[:1].upper() + text[1:]


def readme(role: Path) -> str:
    meta = _load(role / "meta/main.yml")
    info = meta["galaxy_info"]
    defaults = _load(role / "defaults/main.yml") or {}
    specs = _load(role / "meta/argument_specs.yml")["argument_specs"]
    deps = [d["role"] if isinstance(d, dict) else d for d in meta.get("dependencies") or []]
    platforms = ", ".join(
        f"{p['name']} {' '.join(map(str, p['versions']))}" for p in info["platforms"]
    )
    lines = [
        f"# rlm.ops.{role.name}",
        "",
        f"{info['description']}.",
        "",
        *textwrap.wrap(_about(role), 100, break_on_hyphens=False),
        "",
        "Generated by `python -m clusterspec.role_docs` from `meta/argument_specs.yml` (types,",
        "descriptions), `defaults/main.yml` (values, and why) and `clusterspec/variables.yml` (the",
        "`rlm_*` site variables, [docs/variables.md](../../docs/variables.md)); edit those.",
        "",
        "```yaml",
        "- hosts: all",
        "  roles:",
        f"    - role: rlm.ops.{role.name}  # {role.name} from a checkout of this repository",
        "```",
        "",
        f"Platforms: {platforms}. Depends on: "
        + (", ".join(f"`{d}`" for d in deps) if deps else "nothing")
        + ".",
    ]
    seen: dict[int, str] = {}
    for entry_name, entry in specs.items():
        lines += ["", f"## Entry point `{entry_name}`: {entry['short_description']}", ""]
        if id(entry) in seen:
            lines.append(f"The same variables as `{seen[id(entry)]}`.")
            continue
        seen[id(entry)] = entry_name
        lines += ["| variable | type | default | description |", "|---|---|---|---|"]
        for name, option in entry.get("options", {}).items():
            kind = option.get("type", "str")
            if option.get("elements"):
                kind += f" of {option['elements']}"
            if option.get("choices"):
                kind += " (" + ", ".join(map(str, option["choices"])) + ")"
            shown = "required" if option.get("required") else _default_cell(name, defaults)
            about = _cell(" ".join(str(option["description"]).split()))
            lines.append(f"| `{name}` | {_cell(kind)} | {shown} | {about} |")
    return "\n".join(lines) + "\n"


def _commented(var: Variable) -> list[str]:
    about = var.description
    if var.choices:
        about += " One of: " + ", ".join(map(str, var.choices)) + "."
    lines = [
        "#",
        *textwrap.wrap(
            about, 98, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False
        ),
    ]
    if var.fact:
        return [*lines, f"# {var.name}:    # default: the fact ansible_facts['{var.fact}']"]
    if isinstance(var.default, dict | list) and var.default:
        dumped = yaml.safe_dump({var.name: var.default}, sort_keys=False, default_flow_style=False)
        return lines + [f"# {line}" for line in dumped.splitlines()]
    return [*lines, f"# {var.name}: {_shown(var.default)}"]


def example_inventory(root: Path = ROOT) -> str:
    """group_vars/all.yml of the example: the site's part as written, then every rlm_* variable
    the site part neither sets nor shows commented out."""
    text = (root / EXAMPLE).read_text(encoding="utf-8")
    site = text.split(EXAMPLE_MARKER)[0].rstrip("\n") + "\n"
    mentioned = set(re.findall(r"^(?:# ?)?(rlm_\w+):", site, flags=re.MULTILINE))
    rest = [var for name, var in variables().items() if name not in mentioned]
    lines = [
        "",
        EXAMPLE_MARKER + "-" * (99 - len(EXAMPLE_MARKER)),
        "# Generated from clusterspec/variables.yml by `python -m clusterspec.role_docs` (do not edit",
        "# below this line; docs/variables.md has the same list as a table). Uncomment to change one.",
    ]
    for var in rest:
        lines += _commented(var)
    return site + "\n".join(lines) + "\n"


def generated(root: Path = ROOT) -> dict[Path, str]:
    """Every file this module writes (relative to root) and its content."""
    out: dict[Path, str] = {}
    for role in roles(root):
        rel = role.relative_to(root)
        out[rel / "meta/argument_specs.yml"] = argument_specs_yaml(role)
        out[rel / "README.md"] = readme(role)
    out[EXAMPLE] = example_inventory(root)
    return out


def stale(root: Path = ROOT) -> list[Path]:
    """The files whose checked-in content differs from what generated() writes."""
    return [
        path
        for path, content in generated(root).items()
        if not (root / path).is_file() or (root / path).read_text(encoding="utf-8") != content
    ]


def main(argv: list[str], root: Path = ROOT) -> int:
    if argv == ["--check"]:
        changed = stale(root)
        for path in changed:
            print(f"{path}: out of date: run python -m clusterspec.role_docs", file=sys.stderr)
        return 1 if changed else 0
    if argv:
        print("usage: python -m clusterspec.role_docs [--check]", file=sys.stderr)
        return 2
    # Computed in full before anything is written: one file's output never feeds another's.
    files = generated(root)
    for path, content in files.items():
        (root / path).write_text(content, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The site-level rlm_* inventory variables (variables.yml): type, default, description.

`python -m clusterspec.variables` prints docs/variables.md.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SPEC = Path(__file__).with_name("variables.yml")
TYPES = ("str", "int", "float", "bool", "list", "dict", "path")


@dataclass(frozen=True)
class Variable:
    name: str
    type: str
    default: Any
    description: str
    choices: tuple[Any, ...] = ()
    fact: str | None = None  # a null default means "the value of this Ansible fact"


@functools.cache
def variables() -> dict[str, Variable]:
    raw = yaml.safe_load(SPEC.read_text(encoding="utf-8"))
    out = {}
    for name, entry in raw.items():
        if entry["type"] not in TYPES:
            raise ValueError(f"{SPEC}: {name} has unknown type {entry['type']!r}")
        out[name] = Variable(
            name=name,
            type=entry["type"],
            default=entry["default"],
            description=" ".join(str(entry["description"]).split()),
            choices=tuple(entry.get("choices") or ()),
            fact=entry.get("fact"),
        )
    return out


def default(name: str) -> Any:
    """The default of an rlm_* variable; KeyError for a name the spec does not define."""
    value = variables()[name].default
    return value.copy() if isinstance(value, list | dict) else value


def markdown() -> str:
    lines = [
        "# Inventory variables",
        "",
        "Generated from `clusterspec/variables.yml` by `python -m clusterspec.variables`; edit that",
        "file, not this one. The Ansible roles, rlmctl and monitoring/file_sd all take their",
        "defaults from it. Role parameters: `roles/<role>/README.md` (`ansible-doc -t role rlm.ops.<role>`).",
        "",
        "| variable | type | default | description |",
        "|---|---|---|---|",
    ]
    for var in variables().values():
        shown = f"`{var.default!r}`" if var.default is not None else "null"
        if var.fact:
            shown = f"fact `{var.fact}`"
        kind = var.type + (f" ({', '.join(map(str, var.choices))})" if var.choices else "")
        lines.append(f"| `{var.name}` | {kind} | {shown} | {var.description} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())

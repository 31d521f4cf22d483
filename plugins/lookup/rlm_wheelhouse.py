"""Lookup `rlm_wheelhouse`: a wheelhouse's manifest and whether it fits a node.

    fit: "{{ lookup('rlm.ops.rlm_wheelhouse', trainer_env_wheelhouse, python='3.13', glibc='2.41',
              machine='x86_64', vendor='none', torch='2.13.0', bundle='0.1.0') }}"

Returns {"manifest": {...} or None, "problems": [one line each], "build": the builder's command
for this node}. `torch=None` (a site stack provides it) asks only for the bundle. The manifest
format and the matching rules are clusterspec/wheelhouse.py's, which the builder writes with.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from ansible.plugins.lookup import LookupBase

DOCUMENTATION = """
name: rlm_wheelhouse
short_description: an offline wheelhouse's manifest and whether it fits a node
description: Reads <wheelhouse>/manifest.json (written by rlmctl wheelhouse) on the controller.
options:
  _terms:
    description: the wheelhouse directory on the controller
    required: true
"""

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from clusterspec import wheelhouse as spec  # noqa: E402


@functools.lru_cache(maxsize=16)
def _load(directory: str, mtime_ns: int) -> tuple[dict | None, str | None]:
    """Once per process and version of the manifest: Ansible templates this for every host."""
    try:
        return spec.load(directory), None
    except spec.WheelhouseError as error:
        return None, str(error)


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **node):
        directory = str(terms[0])
        try:
            mtime = (Path(directory) / spec.MANIFEST).stat().st_mtime_ns
        except OSError:
            mtime = 0
        manifest, error = _load(directory, mtime)
        build = spec.build_command(
            node.get("python") or "3.X", node.get("vendor") or "none", node.get("glibc")
        )
        if error or manifest is None:
            return [{"manifest": None, "problems": [error], "build": build}]
        found = spec.problems(
            manifest,
            python=str(node["python"]),
            glibc=str(node["glibc"]),
            machine=str(node["machine"]),
            vendor=str(node["vendor"]),
            torch=None if node.get("torch") in (None, "") else str(node["torch"]),
            bundle_version=str(node["bundle"]),
        )
        # Each wheel keyed by file and hash, as the node's probe lists what it has.
        wheels = [w | {"key": f"{w['file']} {w['sha256']}"} for w in manifest["wheels"]]
        return [{"manifest": manifest | {"wheels": wheels}, "problems": found, "build": build}]

"""Lookup `rlm_default`: the default of a site-level rlm_* variable from clusterspec/variables.yml.

    some_role_var: "{{ rlm_gpu_vendor | default(lookup('rlm.ops.rlm_default', 'rlm_gpu_vendor')) }}"

The roles' only way to default an rlm_* variable, so that Ansible, rlmctl and the exporter agree.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml
from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = """
name: rlm_default
short_description: default of a site-level rlm_* inventory variable
description: Reads clusterspec/variables.yml, the one file of rlm_* defaults.
options:
  _terms:
    description: variable names
    required: true
"""

SPEC = Path(__file__).resolve().parents[2] / "clusterspec" / "variables.yml"


# libyaml's loader where PyYAML has it: the pure-Python one takes 40-160 ms for this file.
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=1)
def _spec(mtime_ns: int) -> dict:
    """The parsed file, once per process and version of the file: Ansible templates a role
    default (so this lookup) on every task that reads it, on every host."""
    return yaml.load(SPEC.read_text(encoding="utf-8"), Loader=LOADER)


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        spec = _spec(SPEC.stat().st_mtime_ns)
        missing = [t for t in terms if t not in spec]
        if missing:
            raise AnsibleLookupError(f"{', '.join(missing)} not defined in {SPEC}")
        # Copies: the cached defaults must not change with what a caller does to its value.
        return [copy.deepcopy(spec[t]["default"]) for t in terms]

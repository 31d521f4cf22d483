"""Lookup `rlm_default`: the default of a site-level rlm_* variable from clusterspec/variables.yml.

    some_role_var: "{{ rlm_gpu_vendor | default(lookup('rlm_default', 'rlm_gpu_vendor')) }}"

The roles' only way to default an rlm_* variable, so that Ansible, rlmctl and the exporter agree.
"""

from __future__ import annotations

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


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        spec = yaml.safe_load(SPEC.read_text(encoding="utf-8"))
        missing = [t for t in terms if t not in spec]
        if missing:
            raise AnsibleLookupError(f"{', '.join(missing)} not defined in {SPEC}")
        return [spec[t]["default"] for t in terms]

"""Lookup `rlm_vendor`: what the Ansible roles need to know of a GPU vendor, read from its one
description, clusterspec/vendors/<vendor>.py (the same module the health gate, the exporter and
the trainer read).

    gpu_power_vendor: "{{ lookup('rlm.ops.rlm_vendor', gpu_detect_vendor) }}"       # one vendor's facts
    pci_ids: "{{ lookup('rlm.ops.rlm_vendor', attribute='pci_vendor_id') }}"         # {vendor: value}

Facts are the description's role-facing attributes (ROLE_FACTS below), lower-cased, tuples as lists.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = """
name: rlm_vendor
short_description: a GPU vendor's facts from clusterspec/vendors/<vendor>.py
description: Reads the vendor descriptions, the one place of vendor facts.
options:
  _terms:
    description: vendor names (none, with attribute, for every vendor)
    required: false
  attribute:
    description: one fact of every vendor, as a dict by vendor
    required: false
"""

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from clusterspec.vendors import VENDORS  # noqa: E402

# The attributes of a vendor description the roles read.
ROLE_FACTS = (
    "NAME",
    "PCI_VENDOR_ID",
    "KERNEL_MODULE",
    "DEVICE_FILES",
    "GRES_FILES",
    "TOOLKIT_HOME",
    "BANDWIDTH_TEST_SOURCE",
    "BANDWIDTH_TEST_MAKE_ARGS",
    "NET_PLUGIN",
    "TORCH_INDEX_URL",
    "POWER_QUERY",
    "POWER_PERSISTENCE",
    "POWER_SET",
    "POWER_AFTER",
    "EXPORTER_JOB",
    "EXPORTER_PACKAGES",
    "EXPORTER_SERVICES",
)


def _plain(value):
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def vendor_facts(vendor: str) -> dict:
    if vendor not in VENDORS:
        raise AnsibleLookupError(
            f"no GPU vendor {vendor!r}: one of {', '.join(VENDORS)} (clusterspec/vendors)"
        )
    module = VENDORS[vendor]
    return {name.lower(): _plain(getattr(module, name)) for name in ROLE_FACTS}


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        attribute = kwargs.get("attribute")
        if attribute:
            return [{vendor: vendor_facts(vendor)[attribute] for vendor in terms or VENDORS}]
        return [vendor_facts(vendor) for vendor in terms]

"""Filters over the GPU vendor descriptions (clusterspec/vendors/<vendor>.py).

gpu_power_gpus: "{{ gpu_power_query.stdout | rlm_power_limits(gpu_detect_vendor) }}"
"""

from __future__ import annotations

import sys
from pathlib import Path

from ansible.errors import AnsibleFilterError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from clusterspec.vendors import VENDORS


def rlm_power_limits(text: str, vendor: str) -> list[dict]:
    """Each GPU's power range and cap parsed from the vendor's POWER_QUERY output."""
    try:
        return VENDORS[vendor].parse_power_limits(text)
    except (KeyError, ValueError, TypeError, AttributeError) as error:
        raise AnsibleFilterError(f"{vendor} power limits unreadable: {error}") from None


class FilterModule:
    def filters(self):
        return {"rlm_power_limits": rlm_power_limits}

"""Names, addresses and paths of one rig instance, all derived from (rig id, slot).

An instance is numbered `NN = 10 * rig_id + slot`. That number appears in every name the rig gives
to a kernel object or a directory, so concurrent instances never share (or delete) anything:

    interfaces and namespaces   rlmNN-br, rlmNN-vK (host end of node K's veth), rlmNN-nK
    subnet                      10.250.NN.0/24: nodes .1 .. .250, bridge (the real host) .254
    state directory             /var/tmp/rlm-rig-NN/
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from tests.rig.errors import RigError

MAX_HOSTS = 250  # addresses .1 .. .250 of the instance's /24; .254 is the real host's bridge
MAX_SLOTS = 10
STATE_ROOT = Path("/var/tmp")
RIG_ID_ENV = "RLM_RIG_ID"


def rig_id_from_env() -> int:
    """The rig id selected by RLM_RIG_ID (0 when unset)."""
    raw = os.environ.get(RIG_ID_ENV, "0").strip() or "0"
    if not re.fullmatch(r"[0-9]", raw):
        raise RigError(
            f"{RIG_ID_ENV} must be one digit 0..9, got {raw!r}; unset it or export e.g. {RIG_ID_ENV}=1"
        )
    return int(raw)


@dataclass(frozen=True)
class Layout:
    rig_id: int
    slot: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rig_id <= 9:
            raise RigError(f"rig id must be 0..9, got {self.rig_id}")
        if not 0 <= self.slot < MAX_SLOTS:
            raise RigError(f"rig slot must be 0..{MAX_SLOTS - 1}, got {self.slot}")

    @property
    def number(self) -> int:
        return 10 * self.rig_id + self.slot

    @property
    def prefix(self) -> str:
        return f"rlm{self.number:02d}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def bridge_ip(self) -> str:
        return f"10.250.{self.number}.254"

    @property
    def subnet(self) -> str:
        return f"10.250.{self.number}.0/24"

    def host_name(self, index: int) -> str:
        return f"node{index}"

    def host_ip(self, index: int) -> str:
        return f"10.250.{self.number}.{index}"

    def netns(self, index: int) -> str:
        return f"{self.prefix}-n{index}"

    def veth(self, index: int) -> str:
        return f"{self.prefix}-v{index}"

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / f"rlm-rig-{self.number:02d}"

    @property
    def shared_dir(self) -> Path:
        return self.state_dir / "shared"

    @property
    def client_dir(self) -> Path:
        """Operator files (key, known_hosts, inventory): also visible read-only inside every host."""
        return self.state_dir / "client"

    def node_dir(self, name: str) -> Path:
        return self.state_dir / "nodes" / name

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    def owns_name(self, name: str) -> bool:
        """Whether an interface or namespace name belongs to this instance."""
        return name.startswith(f"{self.prefix}-")


def slot_layouts(rig_id: int) -> list[Layout]:
    return [Layout(rig_id, slot) for slot in range(MAX_SLOTS)]

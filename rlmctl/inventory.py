"""The inventory loader moved to `clusterspec.inventory` (read by rlmctl and monitoring/file_sd);
these names stay importable from here."""

from __future__ import annotations

from clusterspec.inventory import DEFAULT_INVENTORY as DEFAULT_INVENTORY
from clusterspec.inventory import DRAINED_GROUP as DRAINED_GROUP
from clusterspec.inventory import TRAINING_GROUP as TRAINING_GROUP
from clusterspec.inventory import Host as Host
from clusterspec.inventory import Inventory as Inventory
from clusterspec.inventory import InventoryError as InventoryError
from clusterspec.inventory import load as load

"""Errors the operator can fix: printed as one line by the CLI, never as a traceback."""

from __future__ import annotations

from clusterspec.inventory import InventoryError as InventoryError


class RlmctlError(Exception):
    """A problem with the operator's input or environment; `str(error)` says what and how to fix.

    Exit code 2 (usage or input error) unless a subclass says otherwise.
    """

    exit_code = 2


class RunNotFound(RlmctlError):
    pass

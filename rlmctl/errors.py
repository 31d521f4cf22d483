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


class GateRefused(RlmctlError):
    """The cluster said no (a host failed the health gate, none could start): exit code 1 (a
    check is critical), not a usage error."""

    exit_code = 1

"""Errors the user can fix: moved to `runcontract.errors`; importable from here too."""

from __future__ import annotations

from runcontract.errors import ConfigError as ConfigError
from runcontract.errors import DataError as DataError
from runcontract.errors import UserError as UserError

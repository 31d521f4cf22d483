"""Errors the user can fix: printed as one line, never as a traceback, exiting with their code."""

from __future__ import annotations

from runcontract.exitcodes import ExitCode


class UserError(Exception):
    """A problem with the user's input; `str(error)` says what is wrong and how to fix it."""

    exit_code: ExitCode = ExitCode.BAD_CONFIG


class ConfigError(UserError):
    exit_code = ExitCode.BAD_CONFIG


class DataError(UserError):
    exit_code = ExitCode.DATA_ERROR

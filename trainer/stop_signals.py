"""SIGTERM/SIGUSR1 during training: a clean stop after the current step, a second SIGTERM exits.

Torch-free, so that `rlm-train train` catches the signals before it loads torch (seconds): under
torchrun, the agent SIGTERMs every rank once one fails, and a rank still importing torch would
otherwise die without a word (a missing data path on a faster rank then left no refusal at all).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from trainer.rundir import ExitCode


class StopSignals:
    """SIGTERM/SIGUSR1 ask for a clean stop after the current step; a second SIGTERM exits now."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}
        # Records the exit (status.json, an exit event) before a second SIGTERM ends the process
        # at once: without it status.json would still say running.
        self.on_abort: Callable[[], None] = lambda: None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGTERM:
            # The operator insists: no checkpoint, restartable exit code.
            sys.stderr.write(f"{name} again: exiting without a checkpoint\n")
            try:
                self.on_abort()
            finally:
                os._exit(ExitCode.FAILED)
        self.requested = name
        sys.stderr.write(f"{name}: stopping after this step and saving a checkpoint\n")

"""Exit codes of the trainer, and the one ranking that turns an attempt's codes into the run's.

The trainer exits with an `ExitCode`; torchrun does not pass it on (any failed worker makes it
exit 1, and it exits 1 after a clean SIGTERM stop too), so the trainer also writes its code into
the run directory (`exit` and `start_refused` events). `attempt_exit_code` is the one place that
decides which code an attempt ended with: rlmctl (status, watch), the launchers on the hosts
(rlmctl's launcher shell, the Slurm node wrapper and batch script) and the exporter all call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum


class ExitCode(IntEnum):
    """Trainer exit codes; `rlmctl watch` decides from them whether a restart can help."""

    OK = 0  # finished, or stopped cleanly on SIGTERM/SIGUSR1 after saving a checkpoint
    FAILED = 1  # unexpected error (crash, hung collective): restartable
    BAD_CONFIG = 2  # user error in config or command line: a restart cannot help
    DATA_ERROR = 3  # data missing, corrupt or not matching the model: a restart cannot help
    NONFINITE = 4  # loss/gradients stayed non-finite past the rollback budget

    @property
    def restartable(self) -> bool:
        return self is ExitCode.FAILED


SIGNAL_BASE = 128  # a process killed by signal n: 128 + n, as a shell reports it


def restartable(code: int | None) -> bool:
    """Whether a restart can help an attempt that ended with `code`: killed by a signal (128+n)
    or unknown counts as a crash; a config, data or non-finite error does not."""
    if code is None or code >= SIGNAL_BASE:
        return True
    try:
        return ExitCode(code).restartable
    except ValueError:
        return True


def attempt_exit_code(trainer_codes: Sequence[int], launcher_codes: Sequence[int]) -> int | None:
    """The code an attempt ended with.

    `trainer_codes`: what the trainer itself recorded for this attempt, oldest first (its `exit`
    and `start_refused` events); the newest wins over the launchers: torchrun reports any worker
    failure as 1 and a clean SIGTERM stop as 1, so only the trainer can tell a data error (3)
    from a crash (1), or a clean stop (0) from either. Except that a launcher killed by a signal
    (128 + n: its host's processes were killed, e.g. by the OOM killer or a lost node) beats a
    trainer (rank 0, elsewhere) that says 0. `launcher_codes`: the exit codes of the launchers
    of the attempt (torchrun per host); the first non-zero one, else 0. None while nothing has
    ended.
    """
    if trainer_codes:
        killed = [code for code in launcher_codes if code >= SIGNAL_BASE]
        return killed[0] if trainer_codes[-1] == 0 and killed else trainer_codes[-1]
    failing = [code for code in launcher_codes if code != 0]
    if failing:
        return failing[0]
    return 0 if launcher_codes else None

"""A stand-in for `python -m trainer train`, run by the real torchrun, that ends the way the
trainer's exit interface says (docs/architecture.md, exit codes): `RLM_STANDIN` picks how.

    refuse-data  a refused start: `start_refused` with exit code 3, exit 3 (a data error)
    stop         `start`, then on SIGTERM the `exit` event of a clean stop (0) and exit 0
    silent       exit 1 before saying anything (a trainer that dies at import)

Only rank 0 writes, as the trainer does.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from runcontract.exitcodes import ExitCode
from runcontract.rundir import RunDir
from runcontract.states import EventKind, RunState


def main() -> int:
    run = RunDir(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("run_dir=")))
    mode = os.environ["RLM_STANDIN"]
    main_rank = os.environ.get("RANK", "0") == "0"
    if mode == "silent":
        return ExitCode.FAILED
    if mode == "refuse-data":
        if main_rank:
            run.append_event(
                EventKind.START_REFUSED, exit_code=int(ExitCode.DATA_ERROR), reason="no data"
            )
        return ExitCode.DATA_ERROR
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    if main_rank:
        run.append_event(EventKind.START, step=0, world_size=1)
        run.write_status(state=RunState.RUNNING, step=1, max_steps=100)
    while not stopping:
        time.sleep(0.1)  # "training" until the stop's SIGTERM
    if main_rank:
        run.write_status(state=RunState.STOPPED, step=1, max_steps=100, exit_code=0)
        run.append_event(EventKind.EXIT, exit_code=0, state=RunState.STOPPED.value, step=1)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())

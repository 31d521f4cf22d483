"""The trainer's own record of the communication path NCCL/RCCL chose (torch-free).

Before the process group starts, `capture` points NCCL's debug log at the run directory
(NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET, NCCL_DEBUG_FILE=<run_dir>/comm-logs/<host>.<pid>.log)
unless the environment already chooses NCCL_DEBUG; after the first collectives `describe`
parses this rank's file with clusterspec.transport: the line the trainer logs at start-up
("comm path: NET/IB/GDRDMA x16; P2P/CUMEM x24; IB NICs mlx5_0:1/IB") and the event it records.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from clusterspec import transport

LOG_DIR = "comm-logs"  # NCCL/RCCL INFO logs, one file per process


def capture(run_dir: str | Path) -> Path | None:
    """This process's NCCL log file, or None when the environment configures NCCL_DEBUG itself."""
    if "NCCL_DEBUG" in os.environ:
        return None
    directory = Path(run_dir) / LOG_DIR
    directory.mkdir(parents=True, exist_ok=True)
    os.environ.update(transport.DEBUG_ENV)
    os.environ["NCCL_DEBUG_FILE"] = str(directory / "%h.%p.log")
    return directory / f"{socket.gethostname()}.{os.getpid()}.log"


def describe(log_file: Path | None) -> dict[str, Any] | None:
    """The parsed path (CommPath.as_dict) from this rank's log; None without NCCL lines (gloo)."""
    if log_file is None or not log_file.exists():
        return None
    path = transport.parse(log_file.read_text(encoding="utf-8", errors="replace"))
    if not path.channels and not path.ib_nics and not path.socket_ifs:
        return None
    return path.as_dict()

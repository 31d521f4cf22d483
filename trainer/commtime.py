"""Time this rank spends in data-parallel communication per optimizer step.

The DDP comm hook (`trainer.distributed.compression_hook`) marks each gradient bucket's all-reduce
when it is handed to the process group and again when its future completes; FSDP's all-gathers
and gradient reduce-scatters are bracketed the same way (`trainer.parallel.timed`). DDP's buffer
broadcast in forward and the loss all-reduce at the end of a step are not counted. Buckets queue behind each other
on the communication stream, so their intervals overlap: the step's communication time is the
length of the union of the intervals, not their sum. It overlaps the backward pass; what matters
to an operator is its share of the step (`comm_time / step_time`), which reaches 1 when the step
waits on the network or on a slow peer.

On CPU (gloo) a mark is the host clock. On a GPU it is a device event recorded on the current
stream (the communication stream inside the hook's callback and inside FSDP's reduce-scatter), so
the figure is the time the collectives ran on the device, not when the host queued them; `take`
is called after the step synchronised the device.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch


class CommTimer:
    """Intervals of gradient communication since the last `take`."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.on_device = device is not None and device.type != "cpu"
        self.device = device
        self._lock = threading.Lock()  # gloo completes futures on its own threads
        self._open: dict[int, Any] = {}
        self._intervals: list[tuple[Any, Any]] = []
        self._next = 0
        # An async collective's future may complete after the step that started it was taken:
        # on the host clock its interval is clipped to the current window, so a step's figure
        # never reaches back before the previous `take`.
        self._window_start = time.perf_counter()

    def _mark(self) -> Any:
        if not self.on_device:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def start(self) -> int:
        """Mark the start of one collective; returns the key that `end` takes."""
        mark = self._mark()
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._open[key] = mark
        return key

    def end(self, key: int) -> None:
        mark = self._mark()
        with self._lock:
            self._intervals.append((self._open.pop(key), mark))

    def take(self) -> float:
        """Seconds covered by the intervals ended since the last call (their union); resets."""
        with self._lock:
            intervals, self._intervals = self._intervals, []
            window_start, self._window_start = self._window_start, time.perf_counter()
        if not intervals:
            return 0.0
        if self.on_device:
            origin = intervals[0][0]
            intervals = [
                (origin.elapsed_time(a) / 1e3, origin.elapsed_time(b) / 1e3) for a, b in intervals
            ]
        else:
            intervals = [(max(start, window_start), end) for start, end in intervals]
        return union_seconds(intervals)


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total

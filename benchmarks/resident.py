"""The process's resident memory, read once or sampled through a block, for the memory benchmarks (CPU tensors are
not visible to tracemalloc, and the kernel's own peak never goes down)."""

from __future__ import annotations

import os
import threading
import time


def resident() -> int:
    """This process's resident memory in bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakResident:
    """The highest resident memory sampled every ``interval_s`` by a thread while the ``with`` block runs."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peak = 0

    def __enter__(self) -> PeakResident:
        self.peak, self._running = resident(), True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, resident())
            time.sleep(self.interval_s)

    def __exit__(self, *_: object) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, resident())

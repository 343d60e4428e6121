"""Per-step communication time: how long collectives ran, and how long compute waited on them.

Total communication is the sum of every collective's run time (on the communication thread
when it overlaps backward). "Exposed" communication is the part compute could not hide: the
time the training thread spent blocked waiting for it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class CommTimer:
    def __init__(self):
        self.comm_s = 0.0
        self.exposed_s = 0.0

    def ran(self, started: float, finished: float) -> None:
        """A collective that ran on the communication thread from `started` to `finished`."""
        self.comm_s += finished - started

    @contextmanager
    def waiting(self):
        """The training thread is blocked on communication inside this block."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.exposed_s += time.perf_counter() - start

    @contextmanager
    def blocking(self):
        """A collective run on the training thread itself: all of it is exposed."""
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.comm_s += elapsed
            self.exposed_s += elapsed

    def take(self) -> tuple[float, float]:
        """(comm_ms, exposed_comm_ms) since the last take."""
        result = (self.comm_s * 1e3, self.exposed_s * 1e3)
        self.comm_s = self.exposed_s = 0.0
        return result

"""What `Group`'s asynchronous calls return: a handle to wait on.

A point-to-point handle waits on its transport work (through the call's `Link`, so a failure
names the call) and then hands it to `retire` (the group's, which frees works late); a collective handle wraps the future of a
call run on the group's communication thread, and says when that thread ran it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Callable

import torch

from paratrain.comm.flight import Call
from paratrain.comm.link import Link


class P2PHandle:
    """The result of isend/irecv: `wait()` blocks until the transfer is done. `failed(call,
    error)` and `retire(works)` are the group's (Group._failed, Group._retire)."""

    def __init__(self, call: Call, link: Link, work, tensor: torch.Tensor, staging: torch.Tensor,
                 failed: Callable[[Call, Exception], None], retire: Callable[[list], None]):
        self._call, self._failed, self._retire = call, failed, retire
        self._link, self._work, self._tensor, self._staging = link, work, tensor, staging
        self.completed = False

    def wait(self) -> None:
        if self.completed:
            return
        try:
            self._link.wait([self._work])
        except Exception as error:
            self._failed(self._call, error)
            raise
        if self._staging is not self._tensor:  # a non-contiguous receive: copy into place
            self._tensor.copy_(self._staging.view(self._tensor.shape))
        self._call.complete()
        self.completed = True
        self._retire(self._link.finished)  # not freed here: see Group._retired
        self._link = self._work = None


class Done:
    """The handle of an isend already done when it returned: its bytes went straight into a
    shared-memory ring (PointToPoint._went_straight, p2p_calls.py)."""

    completed = True

    def wait(self) -> None:
        return None


DONE = Done()


def timed(execute):
    """(execute(), when it started, when it ended): what a CollectiveHandle's future holds."""
    started = time.perf_counter()
    result = execute()
    return result, started, time.perf_counter()


class CollectiveHandle:
    """An async collective in flight. `wait()` returns its result (or raises its error);
    `started`/`finished` (perf_counter seconds) say when the communication thread ran it."""

    def __init__(self, future: Future, op: str, seq: int):
        self._future, self.op, self.seq = future, op, seq
        self.started = self.finished = None

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self):
        result, self.started, self.finished = self._future.result()
        return result

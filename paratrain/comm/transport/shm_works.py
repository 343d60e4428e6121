"""What the shared-memory transport (shm.py) holds for messages in flight: a send, a posted
receive, a message that came before its receive, and each end of a ring with its queues. A
work's `owner` is the transport (shm.SharedMemoryP2P): waiting on a work is its wait."""

from __future__ import annotations

import ctypes
from collections import deque
import torch

from paratrain.comm.ops import combine_
from paratrain.comm.transport.shm_ring import Ring


class Send:
    """A send: its tensor's bytes, by address (the tensor is held until they are in the ring)."""

    __slots__ = ("peer", "kind", "tag", "tensor", "address", "nbytes", "sent", "done", "error", "owner")

    def __init__(self, owner, peer: int, tag: int, tensor: torch.Tensor):
        self.owner, self.peer, self.kind, self.tag = owner, peer, "send", tag
        self.tensor, self.address, self.nbytes = tensor, tensor.data_ptr(), tensor.nbytes
        self.sent, self.done, self.error = 0, False, None

    def wait(self, timeout: float) -> None:
        self.owner.wait(self, timeout)


class Recv:
    """A posted receive. It fills its buffer from the ring, or, if its message arrived before
    it was posted, from that message's `arrival` once complete. A receive that reduces lands in
    a staging buffer (`tensor`) and is combined into its `target` by the wait that sees it done."""

    __slots__ = ("peer", "kind", "tag", "tensor", "address", "nbytes", "done", "error", "arrival", "owner",
                 "target", "reduce")

    def __init__(self, owner, peer: int, tag: int, tensor: torch.Tensor,
                 target: torch.Tensor | None = None, reduce: str | None = None):
        self.owner, self.peer, self.kind, self.tag = owner, peer, "recv", tag
        self.tensor, self.address, self.nbytes = tensor, tensor.data_ptr(), tensor.nbytes
        self.done, self.error, self.arrival = False, None, None
        self.target, self.reduce = target, reduce

    def wait(self, timeout: float) -> None:
        self.owner.wait(self, timeout)
        if self.target is not None:  # combined once, by the caller's thread (never inside a ring's move)
            combine_(self.target, self.tensor, self.reduce)
            self.owner.staging.give_back(self.tensor)
            self.target = None

    def landing(self, total: int) -> int | None:
        """Where a message of `total` bytes goes: this buffer, or nowhere if it does not fit."""
        if total != self.nbytes:
            self.error = ValueError(f"recv from rank {self.peer} (tag {self.tag}): the message has {total} bytes, "
                                    f"the receive's buffer {self.nbytes}")
            return None
        return self.address

    def finish(self) -> None:
        self.done = True

    def take_arrival(self) -> None:
        """Copy a message that came before this receive was posted, once it is complete."""
        if self.arrival is not None and self.arrival.done:
            if self.landing(self.arrival.nbytes) is not None:
                ctypes.memmove(self.address, self.arrival.address, self.nbytes)
            self.arrival, self.done = None, True


class Arrival:
    """A message no receive was posted for yet: it lands in a buffer of its own."""

    __slots__ = ("buffer", "address", "nbytes", "done")

    def __init__(self, total: int):
        self.buffer = torch.empty(total, dtype=torch.uint8)
        self.address, self.nbytes, self.done = self.buffer.data_ptr(), total, False

    def landing(self, total: int) -> int:
        return self.address

    def finish(self) -> None:
        self.done = True


class Outgoing:
    """This process's end of the ring to one peer."""

    def __init__(self, ring: Ring):
        self.ring, self.head, self.tail = ring, ring.head, ring.tail
        self.queue: deque[Send] = deque()  # sends not yet wholly in the ring, oldest first
        self.populated = False  # its pages are mapped in at the first send (Ring.populate)


class Incoming:
    """This process's end of the ring from one peer, and the receives waiting on it."""

    def __init__(self, ring: Ring):
        self.ring, self.tail = ring, ring.tail
        self.populated = False  # its pages are mapped in at the first message (Ring.populate)
        self.posted: dict[int, deque[Recv]] = {}       # tag -> receives, in posting order
        self.arrived: dict[int, deque[Arrival]] = {}   # tag -> messages ahead of their receive
        self.current = None  # where the message being read goes (a Recv or an Arrival)


def take_oldest(queues: dict, tag: int, queue: deque):
    """The oldest of `queue` (queues[tag]), dropping the tag once it is empty: every collective
    call has a tag of its own, so emptied queues kept would pile up call after call."""
    oldest = queue.popleft()
    if not queue:
        del queues[tag]
    return oldest

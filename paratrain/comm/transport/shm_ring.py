"""One direction between two processes of one host: a ring buffer in a shared file.

The file holds three counters, each on its own 64-byte line, then `capacity` bytes of data:

    head     bytes the sender has written, ever (only the sender moves it)
    tail     bytes the receiver has read, ever (only the receiver moves it)
    waiting  set by a sender that found the ring full, so the receiver knows to wake it
    sleeping set by a receiver about to sleep, so the sender knows to wake it

A message goes in as fragments, each a 64-byte header (tag, the whole message's size, this
fragment's offset in it, its length) and its payload rounded up to 64 bytes, so every header
starts on a line and never wraps; a payload may wrap around the ring's end and is then copied
in two pieces. A message larger than the free space goes in as several fragments, the next
once the receiver has made room.

The receiver must never see a head before the payload it announces. x86-64 keeps stores in
order, so writing the payload and then the head is enough there; Python cannot ask for a
memory fence, so the shared-memory path is used on x86-64 only (see shm.py).
"""

from __future__ import annotations

import mmap
import os
from typing import NamedTuple

import torch

LINE = 64
_WORDS_PER_LINE = LINE // 8
_HEAD, _TAIL, _WAITING, _SLEEPING = (i * _WORDS_PER_LINE for i in range(4))  # int64 indexes of the counters
_COUNTERS = 4 * LINE  # bytes before the data


def round_up(nbytes: int) -> int:
    return -(-nbytes // LINE) * LINE


class Fragment(NamedTuple):
    tag: int
    total: int   # bytes in the whole message
    offset: int  # where this fragment's payload goes in it
    length: int  # payload bytes in this fragment


class Ring:
    """The mapping of one ring file, seen from either end (each end moves only its own counter)."""

    def __init__(self, path: str, capacity: int, create: bool):
        if capacity <= 0 or capacity % LINE:
            raise ValueError(f"ring capacity must be a positive multiple of {LINE} bytes, got {capacity}")
        size = _COUNTERS + capacity
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)  # sparse: a page takes memory only once written
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {size}: "
                                 "both ends must use the same PARATRAIN_SHM_BYTES")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.capacity = capacity
        self._words = memoryview(self._map).cast("q")  # counters and headers, read and written in place
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_COUNTERS, count=capacity)

    # ---- counters (a Python int read or write of one aligned 8-byte word) ----------------

    @property
    def head(self) -> int:
        return self._words[_HEAD]

    @property
    def tail(self) -> int:
        return self._words[_TAIL]

    @property
    def sender_waiting(self) -> bool:
        return self._words[_WAITING] != 0

    def set_sender_waiting(self, waiting: bool) -> None:
        self._words[_WAITING] = int(waiting)

    @property
    def receiver_sleeping(self) -> bool:
        return self._words[_SLEEPING] != 0

    def set_receiver_sleeping(self, sleeping: bool) -> None:
        self._words[_SLEEPING] = int(sleeping)

    # ---- the sender's side ---------------------------------------------------------------

    def write(self, head: int, fragment: Fragment, payload: torch.Tensor) -> int:
        """Write `fragment` (its payload: uint8, `fragment.length` long) at `head`, then publish
        it by moving the shared head; returns the new head. The caller has checked the room:
        LINE + round_up(length) bytes."""
        position = head % self.capacity
        word = (_COUNTERS + position) // 8
        words = self._words
        words[word], words[word + 1], words[word + 2], words[word + 3] = fragment
        self._copy(position + LINE, payload, into_ring=True)
        head += LINE + round_up(fragment.length)
        self._words[_HEAD] = head  # after the payload: x86 makes them visible in this order
        return head

    # ---- the receiver's side -------------------------------------------------------------

    def fragment_at(self, tail: int) -> Fragment:
        word = (_COUNTERS + tail % self.capacity) // 8
        return Fragment(*self._words[word : word + 4].tolist())

    def read(self, tail: int, fragment: Fragment, into: torch.Tensor | None) -> int:
        """Copy the payload of `fragment` (found at `tail`) into `into` (uint8, its length; None
        drops it), then free its room by moving the shared tail; returns the new tail."""
        if into is not None:
            self._copy((tail + LINE) % self.capacity, into, into_ring=False)
        tail += LINE + round_up(fragment.length)
        self._words[_TAIL] = tail
        return tail

    def _copy(self, position: int, outside: torch.Tensor, into_ring: bool) -> None:
        """Copy between `outside` and the ring's bytes from `position` on, wrapping at the end."""
        position %= self.capacity
        first = min(outside.numel(), self.capacity - position)
        pieces = [(self._data[position : position + first], outside[:first])]
        if first < outside.numel():
            pieces.append((self._data[: outside.numel() - first], outside[first:]))
        for ring_part, outside_part in pieces:
            if into_ring:
                ring_part.copy_(outside_part)
            else:
                outside_part.copy_(ring_part)

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

import ctypes
import mmap
import os
from typing import NamedTuple

LINE = 64
_WORDS_PER_LINE = LINE // 8
_HEAD, _TAIL, _WAITING, _SLEEPING = (i * _WORDS_PER_LINE for i in range(4))  # int64 indexes of the counters
_COUNTERS = 4 * LINE  # bytes before the data
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux's numbers; Python's mmap names them only from 3.13


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
        # Payloads are copied by address (ctypes.memmove), not as tensors: on the pipeline's
        # critical path each tensor operation cost 10-20 us cold, a memmove call about 1.
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))  # where native code finds it
        self._data = self.address + _COUNTERS

    def populate(self, writing: bool) -> None:
        """Map every page of the ring into this process now, before its first message: a file
        under /dev/shm starts sparse, and each page first touched mid-message costs a page
        fault (on this project's virtual machine 32 KiB messages took 4x as long on the ring's
        first pass as after). madvise's POPULATE_WRITE / POPULATE_READ (Linux 5.14) where the
        kernel has them, else a touch of every page."""
        try:
            self._map.madvise(_MADV_POPULATE_WRITE if writing else _MADV_POPULATE_READ)
        except (OSError, ValueError):
            page = mmap.PAGESIZE
            if writing:
                ctypes.memset(self._data, 0, self.capacity)  # the ring's bytes mean nothing until a head covers them
            else:
                for offset in range(0, self.capacity, page):
                    ctypes.c_char.from_address(self._data + offset).value

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

    def write(self, head: int, fragment: Fragment, payload: int) -> int:
        """Write `fragment`, its payload `fragment.length` bytes from address `payload`, at
        `head`, then publish it by moving the shared head; returns the new head. The caller has
        checked the room: LINE + round_up(length) bytes."""
        position = head % self.capacity
        word = (_COUNTERS + position) // 8
        words = self._words
        words[word], words[word + 1], words[word + 2], words[word + 3] = fragment
        self._copy(position + LINE, payload, fragment.length, into_ring=True)
        head += LINE + round_up(fragment.length)
        self._words[_HEAD] = head  # after the payload: x86 makes them visible in this order
        return head

    # ---- the receiver's side -------------------------------------------------------------

    def fragment_at(self, tail: int) -> Fragment:
        word = (_COUNTERS + tail % self.capacity) // 8
        return Fragment(*self._words[word : word + 4].tolist())

    def read(self, tail: int, fragment: Fragment, into: int | None) -> int:
        """Copy the payload of `fragment` (found at `tail`) to address `into` (None drops it),
        then free its room by moving the shared tail; returns the new tail."""
        if into is not None:
            self._copy(tail + LINE, into, fragment.length, into_ring=False)
        tail += LINE + round_up(fragment.length)
        self._words[_TAIL] = tail
        return tail

    def _copy(self, position: int, outside: int, length: int, into_ring: bool) -> None:
        """Copy `length` bytes between address `outside` and the ring from `position` on,
        wrapping at the ring's end."""
        position %= self.capacity
        first = min(length, self.capacity - position)
        pieces = [(self._data + position, outside, first)]
        if first < length:
            pieces.append((self._data, outside + first, length - first))
        for ring_part, outside_part, size in pieces:
            if into_ring:
                ctypes.memmove(ring_part, outside_part, size)
            else:
                ctypes.memmove(outside_part, ring_part, size)

"""A shared segment for the collectives of a group whose processes all share this host.

The rings (shm_ring.py) carry messages: a collective made of messages pays each one's
bookkeeping, and its bytes are copied into a ring, out of it, and only then reduced. MPI's
collectives on one host skip all that: each process copies its input once into a segment every
process maps, they agree that everyone has, and each reads what it needs straight from its peers'
copies. The arena is that segment; algorithms/shared.py are the collectives over it.

Layout of the file (created by the group's rank 0, opened by the others, see shm_setup.py):

    a 64-byte line per rank: word 0 is that rank's step, how many times it has arrived;
                             word 1 is up while it sleeps waiting for a step
    two halves, each a slot of `slot_bytes` per rank

A step is a barrier without messages: a rank writes its new step and waits until every other
rank's is as high. Collectives use the halves in turn, one per piece of a message, and a rank
writes into a half only after a step that every peer reached after reading it the time before:
so one step per piece is all the synchronization a one-shot collective needs.

A wait polls the peers' steps (yielding the core between looks, as MPI's shared-memory polling
does) for `spin_s`, then sleeps on this process's doorbell (the rings' named pipe, shm.py), having
raised its flag (word 1 of its line): a rank that takes a step rings the bell of every peer whose
flag is up. A sleep lasts at most _NAP_S, a little longer each time from _FIRST_NAP_S, so a ring
lost in the window x86 leaves between a flag and a step (or taken by another thread of the
process sleeping on the same bell) costs that much at most. Every _LOOK_S it checks
that the ranks it waits for still exist (TransportFailure when one has gone) and it gives up
after its timeout (TransportTimeout), naming the rank it was waiting for. While it waits it moves
this process's messages in the rings too (`progress`): a peer may be blocked on a ring we must
read before it can arrive.

As with the rings, a step is published after the data it covers by the order of stores,
which x86-64 keeps: the arena exists only where the rings do.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import threading
import time
from array import array
from typing import NamedTuple

import torch

from paratrain.comm import native
from paratrain.comm.errors import TransportFailure, TransportTimeout
from paratrain.lifetime import start_time

LINE = 64
_WORDS_PER_LINE = LINE // 8
_LOOK_S = 0.05  # how often a wait checks that its peers' processes still exist
_NAP_S = 0.001  # the longest nap between looks, once polling has gone on for `spin_s`
_FIRST_NAP_S = 20e-6
# Every wait on the main thread polls at least this long, even where the host has fewer cores
# than ranks (spin_s 0): peers of a collective mostly arrive within it, a nap costs 60 us or more
# of timer slack, and a poll yields the core to any process that has work.
_LEAST_POLL_S = 200e-6

# What one group's arena may take of /dev/shm: 2 halves of a slot per rank. 1 MiB slots keep a
# piece's copy-in and its peers' reads inside the caches of a core (bench collectives shows it),
# and a large all-reduce pays one step per piece, a small share of its time.
_BUDGET_BYTES = 16 << 20
_MOST_SLOT_BYTES = 1 << 20
_LEAST_SLOT_BYTES = 64 << 10
_VIEWS_KEPT = 256  # views of the slots (Arena.rows), per arena
# A native piece polls at most this long before Python takes over the wait (which also moves the
# rings' messages and checks that the peers live); spin_s may be 50 ms.
_MOST_NATIVE_POLL_NS = 1_000_000
_MAIN_THREAD = threading.main_thread().ident


def slot_bytes_for(ranks: int) -> int:
    """Each rank's slot in a group of `ranks` (the same on every rank: it depends on nothing else)."""
    return max(_LEAST_SLOT_BYTES, min(_MOST_SLOT_BYTES, _BUDGET_BYTES // (2 * ranks)) // LINE * LINE)


def arena_bytes(ranks: int) -> int:
    return ranks * LINE + 2 * ranks * slot_bytes_for(ranks)


class Rows(NamedTuple):
    """The same elements of every rank's slot: as one tensor (ranks x elements), and row by row."""

    every: torch.Tensor
    each: tuple[torch.Tensor, ...]


class Arena:
    """This rank's mapping of its group's segment."""

    def __init__(self, mapping: mmap.mmap, ranks: int, rank: int, peers: dict[int, tuple[int, bytes]],
                 spin_s: float):
        """`mapping` holds the segment; a step waits for the ranks of `peers`."""
        self.size, self.rank = ranks, rank
        self.slot_bytes = slot_bytes_for(ranks)
        self._map = mapping
        self._words = memoryview(self._map).cast("q")
        self._mine = rank * _WORDS_PER_LINE
        self._others = [(peer, peer * _WORDS_PER_LINE) for peer in sorted(peers)]
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._data = ranks * LINE  # where the halves start
        self.address = self._bytes.data_ptr()
        self.peers = peers  # rank -> (pid, start time), to tell that it still runs
        self.spin_s = spin_s
        self._native_poll_ns = min(int(max(spin_s, _LEAST_POLL_S) * 1e9), _MOST_NATIVE_POLL_NS)
        self._barrier = None  # the native plan of a step alone (barrier)
        self.progress = None  # moves this process's ring messages while it waits (SharedMemoryP2P)
        self.bell = None  # the read end of this process's doorbell, to sleep on (shm_setup.py)
        self.ring = None  # ring(peer): write a byte to peer's doorbell
        self.native = None  # native.Kernels where every rank of the group loaded them (shm_setup.py)
        # cross_memory.CrossMemory where every rank may read its peers' memory, False where not,
        # None until the first call that would use it finds out (algorithms/shared.py)
        self.cross_memory = None
        self.step = 0
        self.uses = 0  # pieces so far: which half the next one takes
        self._rows: dict[tuple, Rows] = {}
        self._populated = False

    @classmethod
    def open(cls, path: str, ranks: int, rank: int, create: bool, peers: dict[int, tuple[int, bytes]],
             spin_s: float) -> Arena:
        """The segment in the file at `path`: created (by the group's rank 0) or opened."""
        size = arena_bytes(ranks)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)  # sparse, and zero: every step starts at 0
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {size}")
            return cls(mmap.mmap(fd, size), ranks, rank, peers, spin_s)
        finally:
            os.close(fd)

    @classmethod
    def alone(cls, ranks: int, rank: int) -> Arena:
        """A segment of this process's own memory whose steps wait for nobody: what paratrain's
        own code is timed against (`bench collectives --overhead`'s path)."""
        return cls(mmap.mmap(-1, arena_bytes(ranks)), ranks, rank, {}, 0.0)

    # ---- where things are ---------------------------------------------------------------

    def next_half(self) -> int:
        """The half the next piece goes in (they alternate; see the module's note)."""
        if not self._populated:
            self._populate()
        half = self.uses & 1
        self.uses += 1
        return half

    def slot_address(self, half: int, rank: int) -> int:
        return self.address + self._data + (half * self.size + rank) * self.slot_bytes

    def write_words(self, half: int, values: list[int]) -> None:
        """`values` as 8-byte integers at the start of this rank's slot of `half` (a header)."""
        start = (self._data + (half * self.size + self.rank) * self.slot_bytes) // 8
        self._words[start : start + len(values)] = array("q", values)

    def read_words(self, half: int, count: int) -> list[list[int]]:
        """The first `count` 8-byte integers of every rank's slot of `half`, rank by rank."""
        first, per_slot = (self._data + half * self.size * self.slot_bytes) // 8, self.slot_bytes // 8
        return [self._words[start : start + count].tolist()
                for start in range(first, first + self.size * per_slot, per_slot)]

    @property
    def waited_for(self) -> list[int]:
        """The ranks a step waits for: every other rank of the group (none for `alone`)."""
        return [peer for peer, _ in self._others]

    def step_word(self, rank: int) -> int:
        """The index of `rank`'s step among the segment's 8-byte words (its sleeping flag is next)."""
        return rank * _WORDS_PER_LINE

    def seen(self, rank: int) -> tuple[int, bool]:
        """`rank`'s step as this rank sees it, and whether it sleeps on its doorbell."""
        index = self.step_word(rank)
        return self._words[index], bool(self._words[index + 1])

    def rows(self, half: int, dtype: torch.dtype, start: int, count: int) -> Rows:
        """Elements [start, start + count) of every rank's slot of `half`, as `dtype`: the rows of
        one tensor (ranks x count), so one reduction over dimension 0 combines them all, and each
        row alone. The views are kept: a training loop asks for the same few every step, and
        making one costs more than the reduction of a small message."""
        key = (half, dtype, start, count)
        rows = self._rows.get(key)
        if rows is None:
            if len(self._rows) >= _VIEWS_KEPT:
                self._rows.clear()
            begin = self._data + half * self.size * self.slot_bytes
            whole = self._bytes[begin : begin + self.size * self.slot_bytes].view(dtype).view(self.size, -1)
            every = whole[:, start : start + count]
            rows = self._rows[key] = Rows(every, every.unbind(0))
        return rows

    def _populate(self) -> None:
        """Map the segment's pages in before its first use: a page first touched mid-collective
        costs a fault (see Ring.populate)."""
        try:
            self._map.madvise(23)  # MADV_POPULATE_WRITE (Linux 5.14); Python's mmap names it from 3.13
        except (OSError, ValueError):
            pass  # the pages fault in at first touch instead
        self._populated = True

    # ---- steps --------------------------------------------------------------------------

    def arrive_and_wait(self, timeout: float) -> None:
        """Take the next step: say so, then wait until every other rank has taken it."""
        self.step += 1
        self._words[self._mine] = self.step
        self._ring_sleepers()
        self._wait_for_all(self.step, timeout)

    def barrier(self, timeout: float) -> None:
        """A step and nothing else; in native code where the group has it, so that ranks leave
        it as close together as they can (a collective timed from a barrier counts the gap)."""
        if self.native is None:
            self.arrive_and_wait(timeout)
            return
        if self._barrier is None:
            self._barrier = self.native_plan()
        self.run_native(ctypes.addressof(self._barrier), timeout)

    def native_plan(self, **fields) -> native.OneShotPlan:
        """A native.OneShotPlan for this rank's steps in this segment (its step word and those of
        the ranks it waits for), with `fields` (what it copies and reduces) set; with none, a
        step alone."""
        peers = self.waited_for
        plan = native.OneShotPlan(words=self.address, mine=self._mine, npeers=len(peers), **fields)
        plan.peers[: len(peers)] = [self.step_word(peer) for peer in peers]
        return plan

    def run_native(self, plan: int, timeout: float) -> int:
        """One piece of a one-shot collective in native code (native.OneShotPlan at address
        `plan`): copy in, take the next step and reduce, in one call where every peer arrives
        within the poll; past that, this rings whom it must and waits as arrive_and_wait does.
        -> native.DONE, or native.CHANGED where a check of the plan failed (the step is taken,
        nothing after it done). A read of a peer's memory that fails raises TransportFailure
        where the peer has gone, else OSError."""
        self.step += 1
        # As _wait_for: a helper thread does not poll, the core is the compute's it overlaps.
        poll_ns = self._native_poll_ns if threading.get_ident() == _MAIN_THREAD else 0
        status = self.native.oneshot(plan, self.step, poll_ns)
        if status == native.DONE:
            return status
        if status in (native.WAIT, native.WAIT_AND_RING):
            if status == native.WAIT_AND_RING:
                self._ring_sleepers()
            self._wait_for_all(self.step, timeout)
            status = self.native.finish(plan)
        if status < 0:  # a read of a peer's memory: say which peer if it has gone
            for peer, _ in self._others:
                self._check_alive(peer)
            raise OSError(-status, f"reading a peer's memory (process_vm_readv): {os.strerror(-status)}")
        return status

    def _ring_sleepers(self) -> None:
        words = self._words
        if self.ring is not None:
            for peer, index in self._others:
                if words[index + 1]:  # asleep waiting for this step, or for a later one
                    self.ring(peer)

    def _wait_for_all(self, step: int, timeout: float) -> None:
        words = self._words
        for peer, index in self._others:
            if words[index] < step:
                self._wait_for(peer, index, step, timeout)

    def _wait_for(self, peer: int, index: int, step: int, timeout: float) -> None:
        words = self._words
        started = time.perf_counter()
        main = threading.current_thread() is threading.main_thread()
        # A helper thread (an async collective beside a backward pass) sleeps at once: the
        # core is the compute's it overlaps.
        spin_until = started + (max(self.spin_s, _LEAST_POLL_S) if main else 0.0)
        look_at, deadline, nap = started + _LOOK_S, started + timeout, _FIRST_NAP_S
        polls = 0
        while words[index] < step:
            polls += 1
            if polls & 63 == 0 and self.progress is not None:
                self.progress()
            now = time.perf_counter()
            if now < spin_until:
                os.sched_yield()
                continue
            if now >= deadline:
                raise TransportTimeout(peer, timeout, f"rank {peer} did not reach step {step} of the shared "
                                                      f"segment in {timeout:g}s (it is at {words[index]})")
            if now >= look_at:
                self._check_alive(peer)
                look_at = now + _LOOK_S
            if self.progress is not None:
                self.progress()
            self._sleep(nap, index, step)
            nap = min(nap * 2, _NAP_S)

    def _sleep(self, seconds: float, index: int, step: int) -> None:
        """Sleep until a peer rings (or `seconds`): the flag goes up first, then the bell is
        emptied (a system call: the flag is out before the step is looked at again), then the
        step is looked at once more, so a step taken in between is not slept past."""
        if self.bell is None:
            time.sleep(seconds)
            return
        words = self._words
        words[self._mine + 1] = 1
        try:
            try:
                os.read(self.bell, 1 << 16)
            except BlockingIOError:
                pass
            if words[index] < step:
                select.select([self.bell], [], [], seconds)
        finally:
            words[self._mine + 1] = 0

    def _check_alive(self, peer: int) -> None:
        pid, started = self.peers[peer]
        if start_time(pid) != started:
            raise TransportFailure(peer, f"rank {peer}'s process (pid {pid}) has exited")

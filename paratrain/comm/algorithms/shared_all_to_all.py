"""The all-to-all through the shared segment (`oneshot` of algorithms/shared.py), in equal and
in uneven parts. Each is one call worked out for its tensors (and sizes) as an object whose
run() makes the call: every call builds one, and a call made again on the same tensors runs the
one it kept (shared_replays.py, replays.py), so its addresses and copies are worked out once.

Either way a rank's part for itself goes straight from its input to its output, and large parts
are read straight from the peers' inputs where the group may (transport/cross_memory.py): one
copy instead of two (into a slot, out of it), and two steps whatever the size.

Equal parts (`EqualAllToAll`): each rank copies its part for each peer into a block of its slot
(n - 1 blocks share it), a step, then copies its block of every peer's slot into its output; a
part larger than a block goes in pieces. Parts of CROSS_MEMORY_LEAST_BYTES or more are read.
Where the group has the native kernels (comm/native) each piece is one call of them, its copies
in, its step and its copies out; reading, the step, the reads and the second step are two.

Uneven parts (`UnevenAllToAll`): blocks of a fixed size per destination would leave most of a
slot empty when one destination takes most of the input, and a rank does not know how long its
peers' parts are. So each slot holds a header (the rank's send and receive sizes and its input's
address), then a piece of its input as it lies, its own part left out. After the first step every
rank knows every rank's sizes, so where its part lies in each peer's input and how many pieces
the longest input takes (every rank takes as many steps), and it copies out of each piece what
falls in its parts: no step more than for equal parts. Past the first piece, where the group may,
the rest of each part is read from its sender's input. A call made again that fits one piece is
one native call: copies in, step, then, if every peer's sizes are those it saw last time (a
peer may change its own while ours stay), the copies out that they gave; else Python reads the
headers and plans anew.

Against MPICH's Alltoall on 2 and 4 processes of this host, the native calls brought the worst
size from 2.13x MPICH's time (256 KiB on 2) to 1.16x (`bench collectives --peer mpi --ops
all_to_all`, docs/results.md): Python's copies and steps had cost 11 us a call, as much as
MPICH's whole call at 16 KiB.
"""

from __future__ import annotations

import ctypes
import functools
from ctypes import memmove

import torch

from paratrain.comm import native
from paratrain.comm.ops import Splits, part_bounds, part_sizes, splits_mismatch
from paratrain.comm.transport import cross_memory
from paratrain.comm.transport.shm_arena import LINE


# From here a part is read from its sender's memory (one copy) rather than passed through a slot
# (two). Below it the reads' system calls and the extra step cost more than the copy they save.
# In native calls here: 64 KiB parts on 4 ranks took 83-114 us read, 180-240 us through the
# slots (the reader copies lines its peer's core has just written); 128 KiB parts on 2 ranks,
# 18-21 us read, 32-42 through the slots; 32 KiB parts on 2 ranks, the same either way.
CROSS_MEMORY_LEAST_BYTES = 64 << 10


class EqualAllToAll:
    """This rank's part of one all-to-all in equal parts (torch.tensor_split's) on `input` and
    `output` (CPU, contiguous)."""

    def __init__(self, arena, input: torch.Tensor, output: torch.Tensor):
        n, me, size = arena.size, arena.rank, input.element_size()
        self.arena, self.n, self.me, self.size = arena, n, me, size
        self.sizes = part_sizes(input.numel(), n)
        self.starts = [low for low, _ in part_bounds(input.numel(), n)]
        self.source, self.address, mine = input.data_ptr(), output.data_ptr(), self.sizes[me]
        self.own_copy = (self.address + me * mine * size, self.source + self.starts[me] * size, mine * size)
        self.peers = [peer for peer in range(n) if peer != me]
        self.reads_peers = self.sizes[0] * size >= CROSS_MEMORY_LEAST_BYTES
        self.per_block = arena.slot_bytes // (max(1, n - 1) * size)  # a block per peer in a slot
        self.first = [self._copies(half, 0) for half in (0, 1)]
        self.published = ctypes.c_int64(self.source)  # what a native call writes in our slot's first word
        self.plans = [None, None]  # the native plan of the first piece in each half (_first_plan)

    def run(self, op_name: str, timeout: float) -> None:
        arena = self.arena
        if self.n == 1:
            memmove(*self.own_copy)
            return
        reads = self.reads_peers and cross_memory.reader_of(arena, timeout) is not None
        if arena.native is not None and self.n <= native.MOST_ROWS:  # a plan holds that many peers
            self._run_natively(reads, timeout)
            return
        memmove(*self.own_copy)
        if reads:
            self._read(cross_memory.reader_of(arena, timeout), timeout)
            return
        for offset in range(0, max(1, self.sizes[0]), self.per_block):  # one piece at least: every rank steps alike
            half = arena.next_half()
            copies_in, copies_out = self.first[half] if offset == 0 else self._copies(half, offset)
            for copy in copies_in:
                memmove(*copy)
            arena.arrive_and_wait(timeout)
            for copy in copies_out:
                memmove(*copy)

    def _first_plan(self, half: int, reads: bool) -> int:
        """The address of the native plan (native.OneShotPlan) of this call's first piece in
        `half`, made at its first use (a call made once, on fresh tensors, uses one half): where it
        `reads` its peers' inputs, the call's first step (our own part copied, our input's address
        published in our slot; then each peer's part for us read from its input); else the first
        piece's copies through the slots."""
        if self.plans[half] is None:
            arena, size, mine = self.arena, self.size, self.sizes[self.me]
            plan = arena.native_plan()
            if reads:
                slot = arena.slot_address(half, self.me)
                plan.set_copies([self.own_copy, (slot, ctypes.addressof(self.published), 8)], [])
                plan.set_reads([(self.address + peer * mine * size, arena.slot_address(half, peer),
                                 self.starts[self.me] * size, mine * size, arena.peers[peer][0])
                                for peer in self.peers])
            else:
                plan.set_copies([self.own_copy, *self.first[half][0]], self.first[half][1])
            self.plans[half] = (plan, ctypes.addressof(plan))
        return self.plans[half][1]

    def _run_natively(self, reads: bool, timeout: float) -> None:
        """Each piece one call of the native kernel: its copies in (the first piece's own part
        too), the step, its copies out; or, reading the peers' inputs, the first step and the
        reads in one call, then a step after which no peer reads our input."""
        arena = self.arena
        if reads:
            arena.run_native(self._first_plan(arena.next_half(), reads), timeout)
            arena.next_half()
            arena.barrier(timeout)
            return
        later = None  # the plan of the pieces after the first, made again for each
        for offset in range(0, max(1, self.sizes[0]), self.per_block):
            half = arena.next_half()
            if offset == 0:
                arena.run_native(self._first_plan(half, reads), timeout)
                continue
            later = later or arena.native_plan()
            later.set_copies(*self._copies(half, offset))
            arena.run_native(ctypes.addressof(later), timeout)

    def _read(self, reader, timeout: float) -> None:
        """Our part of each peer's input, read from it (cross_memory.py), between two steps."""
        size, mine = self.size, self.sizes[self.me]
        inputs = cross_memory.publish_input(self.arena, self.source, timeout)
        for peer in self.peers if mine else ():
            reader.read(peer, self.address + peer * mine * size, inputs[peer] + self.starts[self.me] * size, mine * size)
        cross_memory.all_have_read(self.arena, timeout)

    def _copies(self, half: int, offset: int) -> tuple[list, list]:
        """(into, from, bytes) of the piece from `offset` on of each part: ours for each peer into
        its block of our slot, and each peer's for us out of its slot."""
        arena, size, me, block = self.arena, self.size, self.me, self.per_block
        slot, mine = arena.slot_address(half, me), self.sizes[me]
        copies_in, copies_out = [], []
        for peer in self.peers:
            count = max(0, min(block, self.sizes[peer] - offset))
            if count:
                copies_in.append((slot + _block_index(peer, me) * block * size,
                                  self.source + (self.starts[peer] + offset) * size, count * size))
            count = max(0, min(block, mine - offset))
            if count:  # part `peer` of the output is what rank `peer` sent us
                copies_out.append((self.address + (peer * mine + offset) * size,
                                   arena.slot_address(half, peer) + _block_index(me, peer) * block * size, count * size))
        return copies_in, copies_out


def _block_index(destination: int, writer: int) -> int:
    """Where in `writer`'s slot the block for `destination` lies: its peers in rank order."""
    return destination - (destination > writer)


class UnevenAllToAll:
    """This rank's part of one uneven all-to-all on `input` and `output` (CPU, contiguous)."""

    def __init__(self, arena, input: torch.Tensor, output: torch.Tensor, splits: Splits):
        n, me, size = arena.size, arena.rank, input.element_size()
        self.arena, self.n, self.me, self.size = arena, n, me, size
        self.header = -(-(2 * n + 1) * 8 // LINE) * LINE  # whole lines: the data after it is aligned for any dtype
        self.per_piece = (arena.slot_bytes - self.header) // size
        self.source, self.address, self.total = input.data_ptr(), output.data_ptr(), input.numel()
        self.words = [*splits.send, *splits.receive, self.source]
        own_low = sum(splits.send[:me])
        self.own = (own_low, own_low + splits.send[me])  # our part for ourselves, in our input
        self.own_copy = (self.address + sum(splits.receive[:me]) * size, self.source + own_low * size,
                         splits.send[me] * size)
        self.first_in = [self._copies_in(half, 0) for half in (0, 1)]
        self.last = None  # the headers seen last, their plan, and the first piece's copies out per half
        self.header_words = (ctypes.c_int64 * len(self.words))(*self.words)
        self.plans = None  # the addresses of the native plans of each half (_plan_natively)

    def run(self, op_name: str, timeout: float) -> None:
        arena = self.arena
        half = arena.next_half()
        if self.plans is not None and arena.run_native(self.plans[half], timeout) == native.DONE:
            return  # the peers' headers were those the plan was made for: it copied out too
        if self.plans is None:  # else the native plan took the step, and found other headers
            memmove(*self.own_copy)
            arena.write_words(half, self.words)
            for copy in self.first_in[half]:
                memmove(*copy)
            arena.arrive_and_wait(timeout)
        headers, wanted, pieces, copies_out = self._plan_of(op_name, half)
        for copy in copies_out:
            memmove(*copy)
        self._plan_natively()
        if pieces == 1:
            return
        # Asked only now: finding out takes steps, and the peers must be done with the first
        # piece's half first.
        if (reader := cross_memory.reader_of(arena, timeout)) is not None:
            self._read_the_rest(reader, headers, wanted)
            cross_memory.all_have_read(arena, timeout)
            return
        for piece in range(1, pieces):
            half = arena.next_half()
            for copy in self._copies_in(half, piece):
                memmove(*copy)
            arena.arrive_and_wait(timeout)
            for copy in self._copies_out(half, piece, wanted):
                memmove(*copy)

    def _plan_natively(self) -> None:
        """For a call that takes one piece, with the headers seen last: the native plan of each
        half, which copies in, steps, checks that every peer's header is the one seen last and
        copies out; the next call runs it. None where the kernels are not loaded, or the call
        takes several pieces."""
        arena, n = self.arena, self.n
        headers, _, pieces, copies_out = self.last
        if arena.native is None or pieces > 1 or n > native.MOST_ROWS:
            self.plans = None
            return
        if self.plans is not None and self.planned_for == headers:
            return
        self.expected = [(ctypes.c_int64 * (2 * n))(*words[:2 * n]) for words in headers]
        plans = []
        for half in (0, 1):
            plan = arena.native_plan()
            header = (arena.slot_address(half, self.me), ctypes.addressof(self.header_words), 8 * len(self.words))
            plan.set_copies([self.own_copy, header, *self.first_in[half]], copies_out[half])
            plan.set_checks([(arena.slot_address(half, peer), ctypes.addressof(self.expected[peer]), 16 * n)
                             for peer in range(n) if peer != self.me])
            plans.append(plan)
        self.kept_plans, self.planned_for = plans, headers
        self.plans = [ctypes.addressof(plan) for plan in plans]

    def _plan_of(self, op_name: str, half: int):
        """Every rank's header from the slots of `half`, and what follows from them (plan)."""
        n = self.n
        headers = self.arena.read_words(half, 2 * n + 1)
        if self.last is None or self.last[0] != headers:
            wanted, pieces = plan(op_name, n, self.me, tuple(tuple(words[:2 * n]) for words in headers),
                                  self.per_piece)
            self.last = (headers, wanted, pieces, [self._copies_out(each, 0, wanted) for each in (0, 1)])
        headers, wanted, pieces, copies_out = self.last
        return headers, wanted, pieces, copies_out[half]

    def _copies_in(self, half: int, piece: int) -> list[tuple[int, int, int]]:
        """(into, from, bytes) of the piece's part of our input, but our own part, into our slot."""
        size, start = self.size, piece * self.per_piece
        end = min(start + self.per_piece, self.total)
        slot = self.arena.slot_address(half, self.me) + self.header
        return [(slot + (low - start) * size, self.source + low * size, (high - low) * size)
                for low, high in ((start, min(self.own[0], end)), (max(self.own[1], start), end)) if high > low]

    def _copies_out(self, half: int, piece: int, wanted) -> list[tuple[int, int, int]]:
        """(into, from, bytes) of what falls in our parts of each peer's piece, from its slot."""
        size, start, arena = self.size, piece * self.per_piece, self.arena
        copies = []
        for peer, (low, high, into) in enumerate(wanted):  # elements [low, high) of peer's input land at `into`
            first, last = max(low, start), min(high, start + self.per_piece)
            if last > first and peer != self.me:
                copies.append((self.address + (into + first - low) * size,
                               arena.slot_address(half, peer) + self.header + (first - start) * size,
                               (last - first) * size))
        return copies

    def _read_the_rest(self, reader, headers, wanted) -> None:
        """What lies past the first piece in our parts, read from each peer's input."""
        size, n = self.size, self.n
        for peer, (low, high, into) in enumerate(wanted):
            first = max(low, self.per_piece)
            if high > first and peer != self.me:
                reader.read(peer, self.address + (into + first - low) * size, headers[peer][2 * n] + first * size,
                            (high - first) * size)


@functools.lru_cache(maxsize=64)
def plan(op_name: str, n: int, me: int, headers: tuple[tuple[int, ...], ...],
         per_piece: int) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """From every rank's header (its send sizes, then its receive sizes): for each peer, where
    this rank's part lies in the peer's input (start, end) and where it goes in this rank's
    output; and the pieces the longest input takes. Every rank reads the same headers, so where
    they disagree every rank raises here, the same error. Kept for the headers seen last: a
    training step's dispatches repeat the same few splits."""
    sends = [row[:n] for row in headers]
    if sends != [column for column in zip(*(row[n:] for row in headers))]:
        every = [Splits(tuple(row[:n]), tuple(row[n:])) for row in headers]
        raise ValueError(f"{op_name}: {splits_mismatch(every)}")
    wanted, into = [], 0
    for send in sends:
        low = sum(send[:me])
        wanted.append((low, low + send[me], into))
        into += send[me]
    return tuple(wanted), max(1, max(-(-sum(send) // per_piece) for send in sends))

"""Collectives through a shared segment (transport/shm_arena.py): no messages at all.

For a group whose processes all share this host (transport "shm"). Each rank copies its input
once into its slot of the segment, takes a step (all ranks have copied), and reads what it needs
straight from its peers' slots: a reduction reads every rank's slot in one operation, a gather
copies each slot once. This is how MPI's implementations do collectives between the processes
of one host; sent as messages through the rings instead, each piece is copied into a ring, out of
it into a staging buffer, and only then reduced, and each message costs its bookkeeping.

"oneshot": every rank does the whole of its part of the work from every slot: for an all-reduce,
every rank reduces the whole message (cheapest in steps and copies; each rank reads n slots).
"twoshot": the all-reduce as MPI does it for large messages, a reduce-scatter and an all-gather
in place in the segment: rank r reduces part r from every peer's slot, a step, then every rank
copies each part from its owner's slot; each rank reads about twice its message whatever n is,
instead of n times, for one step more.

A message larger than a slot goes through in pieces of a slot each; the halves of the segment
alternate, so one piece's copy-in does not wait for the peers still reading the previous one.
The all-to-all, which reads large parts straight from the peers' inputs where the group may,
is in shared_all_to_all.py.

A call made again on the same tensors replays a form of these worked out once
(shared_replays.py), in C where it can (shared_kernels.py).
"""

from __future__ import annotations

import functools
from ctypes import memmove

import torch

from paratrain.comm.algorithms import direct
from paratrain.comm.algorithms.shared_kernels import all_reduce_natively
from paratrain.comm.algorithms.shared_all_to_all import EqualAllToAll, UnevenAllToAll
from paratrain.comm.link import Link
from paratrain.comm.ops import Splits, combine_, part_bounds
from paratrain.comm.transport.shm_arena import Rows

SHARED_ALGORITHMS = ("oneshot", "twoshot")


def arena_of(link: Link):
    arena = getattr(link.transport, "arena", None)
    if arena is None:
        raise ValueError(f"{link.op_name}: the shared-segment algorithms need every rank of the group on "
                         f"this host's shared memory (transport 'shm'); this group's is '{link.transport.kind}'")
    return arena


def _on_cpu(fallback):
    """The algorithm for CPU tensors (copied by address); tensors elsewhere (CUDA over gloo) take
    `fallback`, direct.py's, whose messages the process group carries."""
    def wrap(algorithm):
        @functools.wraps(algorithm)
        def run(link: Link, tensor: torch.Tensor, *rest):
            if tensor.device.type != "cpu":
                return fallback(link, tensor, *rest)
            return algorithm(link, tensor, *rest)
        return run
    return wrap


def reduce_rows(rows: Rows, out: torch.Tensor, op: str) -> None:
    """out <- every rank's row combined, in one operation."""
    if op in ("sum", "avg"):
        if out.dtype == torch.bool:  # torch.sum of booleans counts them; a reduction of flags is an or
            torch.any(rows.every, dim=0, out=out)
        elif len(rows.each) == 2:  # an add costs half of a sum over dimension 0
            torch.add(rows.each[0], rows.each[1], out=out)
        else:
            torch.sum(rows.every, dim=0, dtype=out.dtype, out=out)
    elif op == "max":
        torch.amax(rows.every, dim=0, out=out)
    else:  # an elementwise fold: torch.amin over dimension 0 of int64 rows took 90x amax's time
        out.copy_(rows.each[0])
        for row in rows.each[1:]:
            torch.minimum(out, row, out=out)


def _pieces(count: int, per_piece: int) -> range:
    """The first element of each piece of `count` elements (at least one piece, so that every
    rank takes the same steps even for an empty part)."""
    return range(0, max(count, 1), per_piece)


@_on_cpu(direct.all_reduce)
def all_reduce(link: Link, buf: torch.Tensor, op: str) -> None:
    """One-shot: every rank reduces every rank's copy of the whole message. (The loop of
    _pieces_through_slots written out: a small all-reduce is the call a training step makes
    most, and a generator costs it a little.)"""
    arena, size = arena_of(link), buf.element_size()
    total, address = buf.numel(), buf.data_ptr()
    per_piece = arena.slot_bytes // size
    pieces = _pieces(total, per_piece)
    if all_reduce_natively(link, arena, buf, op, pieces, per_piece):
        return
    for start in pieces:
        count = min(per_piece, total - start)
        half = arena.next_half()
        memmove(arena.slot_address(half, link.rank), address + start * size, count * size)
        arena.arrive_and_wait(link.timeout)
        out = buf if count == total else buf[start : start + count]
        rows = arena.rows(half, buf.dtype, 0, count)
        if link.size == 2:  # `out` holds our own values, and a + b == b + a: both ranks get the same bits
            combine_(out, rows.each[1 - link.rank], op)
        else:
            reduce_rows(rows, out, op)


@_on_cpu(direct.all_reduce)
def all_reduce_twoshot(link: Link, buf: torch.Tensor, op: str) -> None:
    """Two-shot, in place in the segment: each rank copies in only the parts its peers reduce
    (part j for rank j), and reduces its own part r straight into its buffer from its peers'
    copies; it publishes the result in the part-r place of its slot, which no peer reads before
    the second step; then every rank copies each part from its owner. Each rank copies in
    (n-1)/n of the message, not all of it, and nothing of its own part leaves its buffer
    before it is reduced."""
    arena, size, n, me = arena_of(link), buf.element_size(), link.size, link.rank
    total, address = buf.numel(), buf.data_ptr()
    per_piece = arena.slot_bytes // size
    others = [peer for peer in range(n) if peer != me]
    for start in _pieces(total, per_piece):
        count = min(per_piece, total - start)
        half = arena.next_half()
        bounds = part_bounds(count, n)
        low, high = bounds[me]
        slot, piece = arena.slot_address(half, me), address + start * size
        memmove(slot, piece, low * size)  # the parts before ours, then those after it
        memmove(slot + high * size, piece + high * size, (count - high) * size)
        arena.arrive_and_wait(link.timeout)
        if high > low:
            mine = buf[start + low : start + high]
            rows = arena.rows(half, buf.dtype, low, high - low).each
            for peer in others:  # in rank order: every run folds the same way
                combine_(mine, rows[peer], op)
            memmove(slot + low * size, mine.data_ptr(), (high - low) * size)
        arena.arrive_and_wait(link.timeout)
        for owner in others:
            low, high = bounds[owner]
            memmove(piece + low * size, arena.slot_address(half, owner) + low * size, (high - low) * size)


@_on_cpu(direct.reduce_scatter)
def reduce_scatter(link: Link, input: torch.Tensor, output: torch.Tensor, op: str) -> None:
    """Each rank copies its input into its slot; rank r reduces part r of every slot into its
    output. An input larger than a slot goes in pieces, each a block per destination."""
    arena, size, n = arena_of(link), input.element_size(), link.size
    bounds = part_bounds(input.numel(), n)
    address = input.data_ptr()
    low, high = bounds[link.rank]
    if input.numel() * size <= arena.slot_bytes:  # one piece: the input as it is, in one copy
        half = arena.next_half()
        memmove(arena.slot_address(half, link.rank), address, input.numel() * size)
        arena.arrive_and_wait(link.timeout)
        if high > low:
            reduce_rows(arena.rows(half, input.dtype, low, high - low), output, op)
        return
    per_block = arena.slot_bytes // (n * size)
    mine = high - low
    for offset in _pieces(bounds[0][1], per_block):  # part 0 is the longest
        half = arena.next_half()
        slot = arena.slot_address(half, link.rank)
        for block, (low, high) in enumerate(bounds):
            count = max(0, min(per_block, high - low - offset))
            memmove(slot + block * per_block * size, address + (low + offset) * size, count * size)
        arena.arrive_and_wait(link.timeout)
        count = max(0, min(per_block, mine - offset))
        if count:
            out = output if count == output.numel() else output[offset : offset + count]
            reduce_rows(arena.rows(half, input.dtype, link.rank * per_block, count), out, op)


@_on_cpu(direct.all_gather)
def all_gather(link: Link, input: torch.Tensor, output: torch.Tensor) -> None:
    """Each rank copies its part into its slot, and into its output while its peers catch up;
    then it copies every peer's slot into its output."""
    arena, size, n, me = arena_of(link), output.element_size(), link.size, link.rank
    bounds = part_bounds(output.numel(), n)
    source, address = input.data_ptr(), output.data_ptr()
    own = address + bounds[me][0] * size
    if own != source:  # not in place (an in-place input is already its part of the output)
        memmove(own, source, input.numel() * size)
    per_piece = arena.slot_bytes // size
    mine = input.numel()
    for offset in _pieces(bounds[0][1], per_piece):
        half = arena.next_half()
        memmove(arena.slot_address(half, me), source + offset * size, max(0, min(per_piece, mine - offset)) * size)
        arena.arrive_and_wait(link.timeout)
        for owner, (low, high) in enumerate(bounds):
            count = max(0, min(per_piece, high - low - offset))
            if owner != me:
                memmove(address + (low + offset) * size, arena.slot_address(half, owner), count * size)


def _pieces_through_slots(link: Link, arena, buf: torch.Tensor, copying: bool):
    """For each piece of `buf`: copy it into this rank's slot (where `copying`), take the step,
    then yield (half, start, count) for the caller to read the slots."""
    size, total, address = buf.element_size(), buf.numel(), buf.data_ptr()
    per_piece = arena.slot_bytes // size
    for start in _pieces(total, per_piece):
        count = min(per_piece, total - start)
        half = arena.next_half()
        if copying:
            memmove(arena.slot_address(half, link.rank), address + start * size, count * size)
        arena.arrive_and_wait(link.timeout)
        yield half, start, count


@_on_cpu(direct.broadcast)
def broadcast(link: Link, buf: torch.Tensor, root: int) -> None:
    """The root copies into its slot; every other rank copies out of it."""
    arena, size, address = arena_of(link), buf.element_size(), buf.data_ptr()
    for half, start, count in _pieces_through_slots(link, arena, buf, copying=link.rank == root):
        if link.rank != root:
            memmove(address + start * size, arena.slot_address(half, root), count * size)


@_on_cpu(direct.reduce)
def reduce(link: Link, buf: torch.Tensor, root: int, op: str) -> None:
    """Every rank copies into its slot; the root reduces them all."""
    arena = arena_of(link)
    for half, start, count in _pieces_through_slots(link, arena, buf, copying=True):
        if link.rank == root:
            reduce_rows(arena.rows(half, buf.dtype, 0, count), buf[start : start + count], op)


@_on_cpu(direct.all_to_all)
def all_to_all(link: Link, input: torch.Tensor, output: torch.Tensor, splits: Splits | None = None) -> None:
    """Each rank copies its own part straight to its output, its parts for its peers into its
    slot, and its parts from them out of theirs (or reads them from their inputs): see
    shared_all_to_all.py."""
    arena = arena_of(link)
    call = EqualAllToAll(arena, input, output) if splits is None else UnevenAllToAll(arena, input, output, splits)
    call.run(link.op_name, link.timeout)


def barrier(link: Link, token: torch.Tensor, op: str) -> None:
    """A step and nothing else."""
    arena_of(link).barrier(link.timeout)

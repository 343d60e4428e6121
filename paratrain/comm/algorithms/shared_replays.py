"""The one-shot calls on given tensors with their addresses and views worked out once, for a
call made again on the same tensors (comm/replays.py): at 16 KiB working them out cost as much
as the copies and the reduction. Each is a function run(timeout) that only copies, steps and
reduces (in C where the kernels apply, shared_kernels.py); it sends no message, so it needs no
Link. The algorithms themselves, read first, are in shared.py.
"""

from __future__ import annotations

from ctypes import memmove

import torch

from paratrain.comm.algorithms.shared import arena_of, reduce_rows
from paratrain.comm.algorithms.shared_all_to_all import EqualAllToAll, UnevenAllToAll
from paratrain.comm.algorithms.shared_kernels import all_reduce_rows, native_plans, running
from paratrain.comm.link import Link
from paratrain.comm.ops import combine_, part_bounds


def replay_all_reduce(link: Link, buf: torch.Tensor, op: str):
    """The one-shot all-reduce of `buf` with everything about it worked out once (its slots,
    the views it reduces, its byte count): a function of the call's Link that only copies, steps
    and reduces, for a replayed all-reduce (replays.py): run(timeout), since it sends no message
    it needs no Link. None where it takes several pieces or is off the CPU."""
    arena, n, me = arena_of(link), link.size, link.rank
    nbytes, address = buf.numel() * buf.element_size(), buf.data_ptr()
    if buf.device.type != "cpu" or nbytes > arena.slot_bytes:
        return None
    plans = native_plans(arena, buf.dtype, op, address, nbytes, address, all_reduce_rows(arena, address, n, me),
                          buf.numel())
    if plans is not None:
        return running(arena, plans)
    slots = [arena.slot_address(half, me) for half in (0, 1)]
    rows = [arena.rows(half, buf.dtype, 0, buf.numel()) for half in (0, 1)]

    def run(timeout: float) -> None:
        half = arena.next_half()
        memmove(slots[half], address, nbytes)
        arena.arrive_and_wait(timeout)
        if n == 2:  # as in all_reduce
            combine_(buf, rows[half].each[1 - me], op)
        else:
            reduce_rows(rows[half], buf, op)

    return run


def replay_reduce_scatter(link: Link, input: torch.Tensor, output: torch.Tensor, op: str):
    """reduce_scatter's call on these tensors worked out once, as replay_all_reduce's (for
    RepeatedCalls, replays.py); None where it takes several pieces, or is empty or off the CPU."""
    arena, me = arena_of(link), link.rank
    nbytes, address = input.numel() * input.element_size(), input.data_ptr()
    if input.device.type != "cpu" or not 0 < nbytes <= arena.slot_bytes:
        return None
    low, high = part_bounds(input.numel(), link.size)[me]
    size = input.element_size()
    plans = native_plans(arena, input.dtype, op, address, nbytes, output.data_ptr(),
                          lambda half: [arena.slot_address(half, rank) + low * size for rank in range(link.size)],
                          high - low)
    if plans is not None:
        return running(arena, plans)
    slots = [arena.slot_address(half, me) for half in (0, 1)]
    rows = [arena.rows(half, input.dtype, low, high - low) for half in (0, 1)]

    def run(timeout: float) -> None:
        half = arena.next_half()
        memmove(slots[half], address, nbytes)
        arena.arrive_and_wait(timeout)
        if high > low:
            reduce_rows(rows[half], output, op)

    return run


def replay_all_gather(link: Link, input: torch.Tensor, output: torch.Tensor):
    """all_gather's call on these tensors worked out once: every copy's addresses and sizes,
    for both halves. None where it takes several pieces, or is empty or off the CPU."""
    arena, me, size = arena_of(link), link.rank, output.element_size()
    bounds = part_bounds(output.numel(), link.size)
    if output.device.type != "cpu" or not 0 < (bounds[0][1] - bounds[0][0]) * size <= arena.slot_bytes:
        return None
    source, address, nbytes = input.data_ptr(), output.data_ptr(), input.numel() * size
    own = address + bounds[me][0] * size
    slots = [arena.slot_address(half, me) for half in (0, 1)]
    copies = [[(address + low * size, arena.slot_address(half, owner), (high - low) * size)
               for owner, (low, high) in enumerate(bounds) if owner != me] for half in (0, 1)]

    def run(timeout: float) -> None:
        if own != source:
            memmove(own, source, nbytes)
        half = arena.next_half()
        memmove(slots[half], source, nbytes)
        arena.arrive_and_wait(timeout)
        for into, out_of, count in copies[half]:
            memmove(into, out_of, count)

    return run


def replay_of(op_name: str, algo: str, link: Link, input: torch.Tensor, output: torch.Tensor,
              op: str | None = None):
    """The replayable form of `algo`'s call of `op_name` on these tensors (flat views of their
    memory; for an all-reduce both are its buffer), where there is one: a one-shot call that
    fits a slot, as run(timeout). None elsewhere: the caller runs the algorithm itself each time."""
    if algo != "oneshot":
        return None
    if op_name == "all_reduce":
        return replay_all_reduce(link, output, op)
    if op_name == "reduce_scatter":
        return replay_reduce_scatter(link, input, output, op)
    if op_name == "all_gather":
        return replay_all_gather(link, input, output)
    if op_name == "all_to_all" and input.device.type == "cpu":  # `op`: the Splits of uneven parts, or None
        arena, name = arena_of(link), link.op_name
        call = EqualAllToAll(arena, input, output) if op is None else UnevenAllToAll(arena, input, output, op)
        return lambda timeout: call.run(name, timeout)
    return None

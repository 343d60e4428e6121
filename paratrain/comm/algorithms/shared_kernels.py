"""The shared segment's calls into its C kernels (comm/native): a one-shot piece described once
as a native.OneShotPlan per half of the segment, then run by address. Used by the one-shot
all-reduce for each of its pieces (shared.py) and by the one-shot replays (shared_replays.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from paratrain.comm import native
from paratrain.comm.link import Link


def native_plans(arena, dtype: torch.dtype, op: str, copy_from: int, copy_bytes: int, out: int,
                 rows: Callable[[int], list[int]], count: int):
    """For each half, the native form of a one-shot piece (native.OneShotPlan): copy `copy_bytes`
    from `copy_from` into this rank's slot, take the step, then out <- the sum of the `count`
    elements at each of rows(half). None where the native kernels do not apply (no library, an
    op other than a sum, a dtype they do not have)."""
    if arena.native is None or op not in ("sum", "avg") or dtype not in native.DTYPES or arena.size > native.MOST_ROWS:
        return None
    plans = []
    for half in (0, 1):
        plan = arena.native_plan(slot=arena.slot_address(half, arena.rank), input=copy_from, copy_bytes=copy_bytes,
                                 out=out, nrows=len(rows(half)), count=count, dtype=native.DTYPES[dtype])
        plan.rows[: plan.nrows] = rows(half)
        plans.append(plan)
    return plans


def all_reduce_rows(arena, address: int, n: int, me: int) -> Callable[[int], list[int]]:
    """What a native one-shot all-reduce of the buffer at `address` adds, per half: on two ranks
    the peer's copy to our own values (a + b == b + a: the same bits on both); on more, every
    slot folded in rank order, the same order on every rank."""
    if n == 2:
        return lambda half: [address, arena.slot_address(half, 1 - me)]
    return lambda half: [arena.slot_address(half, rank) for rank in range(n)]


def all_reduce_natively(link: Link, arena, buf: torch.Tensor, op: str, pieces: range, per_piece: int) -> bool:
    """all_reduce's pieces, each one call of the native kernel (a plan per half, pointed at the
    piece; `pieces`, the first element of each): False where the kernels do not apply. A 64 MiB message is 64 pieces: each saves the
    Python of its copy, step and add."""
    size, total, address = buf.element_size(), buf.numel(), buf.data_ptr()
    two = link.size == 2  # row 0 is our own piece (all_reduce_rows)
    rows = all_reduce_rows(arena, address, link.size, link.rank)
    plans = native_plans(arena, buf.dtype, op, address, 0, address, rows, 0)
    if plans is None:
        return False
    addresses = [ctypes.addressof(plan) for plan in plans]
    for start in pieces:
        half = arena.next_half()
        plan, piece, count = plans[half], address + start * size, min(per_piece, total - start)
        plan.input = plan.out = piece
        plan.copy_bytes, plan.count = count * size, count
        if two:
            plan.rows[0] = piece
        arena.run_native(addresses[half], link.timeout)
    return True


def running(arena, plans: list) -> Callable[[float], None]:
    """The call that runs the native plan of the half each piece takes."""
    addresses = [ctypes.addressof(plan) for plan in plans]

    def run_native(timeout: float) -> None:
        arena.run_native(addresses[arena.next_half()], timeout)

    run_native.plans = plans  # they live as long as the call that reads them
    return run_native

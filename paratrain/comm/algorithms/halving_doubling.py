"""Recursive halving (reduce-scatter) and recursive doubling (all-gather), Rabenseifner style.

log2(n) steps instead of the ring's n-1, moving the same 2(n-1)/n of the buffer in all, so it
wins at medium sizes where the ring's per-step latency still shows.

Sizes that are not a power of two: with p the largest power of two <= n and e = n - p, ranks
0..2e-1 pair up (2i, 2i+1). The even rank of a pair hands its data to the odd one and sits the
power-of-two phase out; the odd one stands for both as "virtual rank" i. Ranks >= 2e are virtual
rank r - e. Virtual rank v owns the contiguous parts v + min(v, e) .. (v+1) + min(v+1, e) - 1.
"""

from __future__ import annotations

import torch

from paratrain.comm.link import Link, Step
from paratrain.comm.ops import part_bounds


class _Layout:
    def __init__(self, size: int, rank: int, count: int):
        self.p = 1 << (size.bit_length() - 1)
        self.extra = size - self.p
        self.rank = rank
        self.offsets = [start for start, _ in part_bounds(count, size)] + [count]
        self.folded = rank < 2 * self.extra and rank % 2 == 0  # sits out the power-of-two phase
        self.partner = rank + 1 if self.folded else rank - 1  # within a pair (2i, 2i+1)
        self.in_pair = rank < 2 * self.extra
        self.virtual = (rank // 2) if self.in_pair else rank - self.extra
        self._views: dict[tuple[int, int, int], torch.Tensor] = {}

    def real(self, virtual: int) -> int:
        return 2 * virtual + 1 if virtual < self.extra else virtual + self.extra

    def first_part(self, virtual: int) -> int:
        return virtual + min(virtual, self.extra)

    def elements(self, buf: torch.Tensor, v_lo: int, v_hi: int) -> torch.Tensor:
        """The elements owned by virtual ranks [v_lo, v_hi): one view per range and call, so
        that the doubling, which moves the very ranges the halving moved, finds them already
        cut into segments (Link cuts each tensor once per call)."""
        key = (id(buf), v_lo, v_hi)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = buf[self.offsets[self.first_part(v_lo)] : self.offsets[self.first_part(v_hi)]]
        return view

    def own_part(self, buf: torch.Tensor, rank: int) -> torch.Tensor:
        return buf[self.offsets[rank] : self.offsets[rank + 1]]


def _halving_steps(layout: _Layout, buf: torch.Tensor, op: str) -> list[Step]:
    v, lo, hi = layout.virtual, 0, layout.p
    distance, steps = layout.p // 2, []
    while distance >= 1:
        mid = lo + distance
        keep, give = ((lo, mid), (mid, hi)) if v < mid else ((mid, hi), (lo, mid))
        peer = layout.real(v ^ distance)
        steps.append(Step(layout.elements(buf, *give), peer, layout.elements(buf, *keep), peer, op))
        lo, hi = keep
        distance //= 2
    return steps


def _doubling_steps(layout: _Layout, buf: torch.Tensor) -> list[Step]:
    v, distance, steps = layout.virtual, 1, []
    while distance < layout.p:
        mine = v & ~(distance - 1)
        theirs = (v ^ distance) & ~(distance - 1)
        peer = layout.real(v ^ distance)
        steps.append(Step(layout.elements(buf, mine, mine + distance), peer,
                          layout.elements(buf, theirs, theirs + distance), peer))
        distance *= 2
    return steps


def all_reduce(link: Link, buf: torch.Tensor, op: str) -> None:
    layout = _Layout(link.size, link.rank, buf.numel())
    if layout.folded:
        link.send(buf, layout.partner)
        link.recv(buf, layout.partner)
        return
    if layout.in_pair:
        link.recv(buf, layout.partner, reduce=op)
    # One run: each step's receive is posted while the step before is in flight.
    link.run_steps(_halving_steps(layout, buf, op) + _doubling_steps(layout, buf))
    if layout.in_pair:
        link.send(buf, layout.partner)


def reduce_scatter(link: Link, input: torch.Tensor, output: torch.Tensor, op: str) -> None:
    layout = _Layout(link.size, link.rank, input.numel())
    if layout.folded:
        link.send(input, layout.partner)
        link.recv(output, layout.partner)
        return
    scratch = link.scratch.copy_of("hd", input)
    if layout.in_pair:
        link.recv(scratch, layout.partner, reduce=op)
    link.run_steps(_halving_steps(layout, scratch, op))
    if layout.in_pair:
        link.send(layout.own_part(scratch, layout.partner), layout.partner)
    output.copy_(layout.own_part(scratch, link.rank))


def all_gather(link: Link, input: torch.Tensor, output: torch.Tensor) -> None:
    layout = _Layout(link.size, link.rank, output.numel())
    if layout.folded:
        link.send(input, layout.partner)
        link.recv(output, layout.partner)
        return
    layout.own_part(output, link.rank).copy_(input)
    if layout.in_pair:
        link.recv(layout.own_part(output, layout.partner), layout.partner)
    link.run_steps(_doubling_steps(layout, output))
    if layout.in_pair:
        link.send(output, layout.partner)

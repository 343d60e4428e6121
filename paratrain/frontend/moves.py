"""Tensors crossing from one set of workers to another, and their gradients crossing back.

A *crossing* moves a replicated tensor from workers A to workers B (a split tensor is gathered
on A first): each worker of B receives a whole copy from one worker of A. The copy on B is a
leaf that remembers the crossing; in backward each worker of A gets the gradient back from one
worker of B (both sides are replicated, so every copy of the gradient is the same and whole),
and continues backward from the tensor it sent. With a `backward` layout the gradient travels
split instead, one part per worker of A, and is gathered there.

Every send on one worker's stream meets its receive on the other's, because the streams are
built in one global order; gradient messages carry a tag made from the crossing's number, so
they match their crossing whatever order the workers reach them in.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass
class Crossing:
    src: tuple[int, ...]  # the workers that sent (a replicated tensor)
    dst: tuple[int, ...]  # the workers that received a copy
    grad_split: int | None = None  # with a backward layout: the axis the gradient travels split along
    length: int = 0  # that axis' length
    refs: int = 0  # live client handles whose graph goes through it

    def forward_pairs(self) -> list[tuple[int, int]]:
        """(sender, receiver): each receiver gets one copy, from itself if it holds one."""
        return [(b if b in self.src else self.src[j % len(self.src)], b) for j, b in enumerate(self.dst)]

    def backward_pairs(self) -> list[tuple[int, int, int]]:
        """(gradient sender, receiver, part index): each original sender gets its gradient,
        from its own copy if it received one."""
        return [(a if a in self.dst else self.dst[i % len(self.dst)], a, i) for i, a in enumerate(self.src)]


def emit_forward(emit, seq: int, crossing_id: int, crossing: Crossing, source: int, temp: int) -> None:
    """Send handle `source` from its workers to the crossing's, arriving as handle `temp`."""
    for sender, receiver in crossing.forward_pairs():
        emit(sender, [seq, "send", [], [source], [0], {"to": receiver, "t": crossing_id}, None])
        emit(receiver, [seq, "recv", [temp], [], [], {"src": sender, "t": crossing_id}, None])


def emit_backward(emit, seq: int, crossing_id: int, crossing: Crossing, keep_graph: bool) -> None:
    """Send the gradient of a crossing's copies back and continue backward from the original.
    `keep_graph`: later gradient exchanges may traverse the same graph (a whole distributed
    backward); a pipeline stage's own exchange frees its part of the graph instead."""
    pairs = crossing.backward_pairs()
    parts = len(crossing.src) if crossing.grad_split is not None else 0
    targets = defaultdict(list)
    for sender, receiver, index in pairs:
        targets[sender].append([receiver, index])
    for sender, to in targets.items():
        emit(sender, [seq, "bw_send", [], [], [], {"t": crossing_id, "to": to, "parts": parts,
                                                   "axis": crossing.grad_split, "retain": keep_graph}, None])
    for sender, receiver, _ in pairs:
        kwargs = {"t": crossing_id, "src": sender, "retain": keep_graph}
        if parts:
            kwargs.update(gather=list(crossing.src), axis=crossing.grad_split, length=crossing.length)
        emit(receiver, [seq, "bw_recv", [], [], [], kwargs, None])

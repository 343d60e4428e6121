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

from paratrain.frontend.creation import signal_placement
from paratrain.frontend.jobs import Refused, union_of
from paratrain.frontend.sharding import Placement


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


class MoveRoutes:
    """Mixed into Router: moves between workers, and backward across them."""

    def _move(self, job, handle, workers, grad_split=None) -> int:
        """A replicated copy of `handle` on `workers` (a split tensor is gathered first)."""
        table = job.table
        source = table.where[handle]
        if source.split is not None:
            handle = self._convert(job, handle, ("gather", source.split), source.workers)
        self._check_alive(source.workers)
        meta = table.meta[handle]
        crossing = Crossing(source.workers, tuple(workers))
        if grad_split is not None:
            crossing.grad_split, crossing.length = grad_split, meta[0][grad_split]
            self._ensure_group(job, source.workers)
        crossing_id = self.next_crossing
        self.next_crossing += 1
        self.crossings[crossing_id] = crossing
        temp = job.temp(Placement(tuple(workers), None), meta)
        emit_forward(lambda w, i: job.emit(w, i, "crossing"), job.seq, crossing_id, crossing, handle, temp)
        table.crossings[temp] = table.crossings.get(handle, frozenset()) | {crossing_id}
        return temp

    def _backward(self, job, args, targs, kwargs) -> None:
        table = job.table
        loss = table.where[args[0]]
        if loss.split is not None:
            raise Refused("backward: the tensor is split over workers; reduce it (sum, mean) first")
        for i in targs[1:]:
            if table.where[args[i]].workers != loss.workers or table.where[args[i]].split is not None:
                args[i] = self._move(job, args[i], loss.workers)
        crossed = union_of(table.crossings.get(args[i]) for i in targs)
        local = bool(kwargs.pop("local", False))
        if crossed and not local:
            kwargs["retain_graph"] = True  # later gradient exchanges traverse this graph again
        job.on_all(loss.workers, "backward", [], args, targs, kwargs)
        if not local:
            for crossing in sorted(crossed, reverse=True):
                emit_backward(job.emit, job.seq, crossing, self.crossings[crossing], keep_graph=True)

    def _cross_backward(self, job, handle) -> None:
        crossing = job.table.direct.get(handle)
        if crossing is None or crossing not in self.crossings:
            raise Refused("cross_backward: this tensor was not moved between workers by gt.signal.tensor")
        emit_backward(job.emit, job.seq, crossing, self.crossings[crossing], keep_graph=False)

    def _reshard(self, job, out, handle, kwargs) -> None:
        """gt.signal.tensor: `handle` laid out as the signal says (moved, split or gathered)."""
        table = job.table
        target = table.signals.get(kwargs.get("signal"))
        if target is None:
            raise Refused(f"signal {kwargs.get('signal')!r} is not in this client's configuration")
        shape, dtype = table.meta[handle]
        placement = signal_placement(target, shape)
        source = table.where[handle]
        current, crossing = handle, None
        if source.workers != placement.workers:
            grad_split = self._backward_layout(table, target, source, shape)
            current = self._move(job, current, placement.workers, grad_split)
            crossing = self.next_crossing - 1
        elif source.split not in (None, placement.split):
            current = self._convert(job, current, ("gather", source.split), source.workers)
        if placement.split is not None and table.where[current].split != placement.split:
            current = self._convert(job, current, ("scatter", placement.split), placement.workers)
        job.on_all(placement.workers, "alias", [out], [current], [0], {}, self._note(placement.workers, target, "reshard"))
        table.where[out], table.meta[out] = placement, (shape, dtype)
        self._add_crossings(table, out, table.crossings.get(current, frozenset()))
        if crossing is not None:
            table.direct[out] = crossing

    def _backward_layout(self, table, target, source, shape) -> int | None:
        """The axis a moved tensor's gradient travels back split along (its `backward` signal)."""
        if target.backward is None:
            return None
        layout = table.signals[target.backward]
        if layout.workers != source.workers:
            raise Refused(f"signal {target.name}: its backward signal {layout.name} is on workers "
                          f"{list(layout.workers)}, but the tensor comes from {list(source.workers)}")
        return signal_placement(layout, shape).split


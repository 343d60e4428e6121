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

from paratrain.frontend.dispatcher.conversions import convert, ensure_group
from paratrain.frontend.dispatcher.creation import signal_placement
from paratrain.frontend.dispatcher.sharding import Placement
from paratrain.frontend.dispatcher import twins
from paratrain.frontend.dispatcher.table import Crossing, Refused, union_of
from paratrain.frontend.protocol import Instruction
from paratrain.frontend.sharding_rules import Gather, Scatter


def emit_forward(job, crossing_id: int, crossing: Crossing, source: int, temp: int) -> None:
    """Send handle `source` from its workers to the crossing's, arriving as handle `temp`."""
    for sender, receiver in crossing.forward_pairs():
        job.emit(sender, Instruction(job.seq, "send", [], [source], [0], {"to": receiver, "crossing": crossing_id}),
                 "crossing")
        job.emit(receiver, Instruction(job.seq, "recv", [temp], [], [], {"src": sender, "crossing": crossing_id}),
                 "crossing")


def emit_backward(job, crossing_id: int, crossing: Crossing, keep_graph: bool) -> None:
    """Send the gradient of a crossing's copies back and continue backward from the original.
    `keep_graph`: later gradient exchanges may traverse the same graph (a whole distributed
    backward); a pipeline stage's own exchange frees its part of the graph instead."""
    if crossing.twin is not None:
        twins.emit_backward(job, crossing_id, crossing, keep_graph)
        return
    pairs = crossing.backward_pairs()
    parts = len(crossing.src) if crossing.grad_split is not None else 0
    targets = defaultdict(list)
    for sender, receiver, index in pairs:
        targets[sender].append([receiver, index])
    for sender, to in targets.items():
        kwargs = {"crossing": crossing_id, "to": to, "parts": parts, "axis": crossing.grad_split, "retain": keep_graph}
        job.emit(sender, Instruction(job.seq, "bw_send", [], [], [], kwargs))
    for sender, receiver, _ in pairs:
        kwargs = {"crossing": crossing_id, "src": sender, "retain": keep_graph}
        if parts:
            kwargs.update(gather=list(crossing.src), axis=crossing.grad_split, length=crossing.length)
        job.emit(receiver, Instruction(job.seq, "bw_recv", [], [], [], kwargs))


def move(job, handle: int, workers, grad_split: int | None = None) -> int:
    """A replicated copy of `handle` on `workers` (a split tensor is gathered first)."""
    router, table = job.router, job.table
    source = table.where[handle]
    if source.split is not None:
        handle = convert(job, handle, Gather(source.split), source.workers)
    router.check_alive(source.workers)
    meta = table.meta[handle]
    crossing = Crossing(source.workers, tuple(workers))
    if grad_split is not None:
        crossing.grad_split, crossing.length = grad_split, meta[0][grad_split]
        ensure_group(job, source.workers)
    crossing_id = router.new_crossing(job, crossing)
    temp = job.temp(Placement(tuple(workers), None), meta)
    emit_forward(job, crossing_id, crossing, handle, temp)
    table.crossings[temp] = table.crossings.get(handle, frozenset()) | {crossing_id}
    return temp


def backward(job, instruction: Instruction) -> None:
    """loss.backward(): the local backward, then every crossing's gradient exchange, newest first."""
    router, table = job.router, job.table
    args, targs, kwargs = list(instruction.args), instruction.targs, dict(instruction.kwargs)
    loss = table.where[args[0]]
    if loss.split is not None:
        raise Refused("backward: the tensor is split over workers; reduce it (sum, mean) first")
    for i in targs[1:]:
        if table.where[args[i]].workers != loss.workers or table.where[args[i]].split is not None:
            args[i] = move(job, args[i], loss.workers)
    crossed = union_of(table.crossings.get(args[i]) for i in targs)
    local = bool(kwargs.pop("local", False))
    if crossed and not local:
        kwargs["retain_graph"] = True  # later gradient exchanges traverse this graph again
    job.on_all(loss.workers, "backward", [], args, targs, kwargs)
    if not local:
        for crossing in sorted(crossed, reverse=True):
            emit_backward(job, crossing, router.crossings[crossing], keep_graph=True)


def cross_backward(job, instruction: Instruction) -> None:
    """A pipeline stage's share of backward: the gradient of a moved tensor goes back."""
    crossing = job.table.direct.get(instruction.args[0])
    if crossing is None or crossing not in job.router.crossings:
        raise Refused("cross_backward: this tensor was not moved between workers by gt.signal.tensor")
    emit_backward(job, crossing, job.router.crossings[crossing], keep_graph=False)


def reshard(job, instruction: Instruction) -> None:
    """gt.signal.tensor: a tensor laid out as the signal says (moved, split or gathered)."""
    router, table = job.router, job.table
    out, handle = instruction.outs[0], instruction.args[0]
    name = instruction.kwargs.get("signal")
    target = table.signals.get(name) if isinstance(name, str) else None
    if target is None:
        raise Refused(f"signal {str(name)[:64]!r} is not in this client's configuration")
    if not target.places:
        raise Refused(f"signal {name!r} places nothing (it has no workers): there is nowhere to move the tensor")
    shape, dtype = table.meta[handle]
    placement = signal_placement(target, shape)
    source = table.where[handle]
    current, crossing = handle, None
    if source.workers != placement.workers:
        backward = instruction.kwargs.get("backward", target.backward)
        grad_split = _backward_layout(table, target.name, backward if isinstance(backward, str) else None,
                                      source, shape)
        current = move(job, current, placement.workers, grad_split)
        crossing = job.new_crossings[-1]
    elif source.split not in (None, placement.split):
        current = convert(job, current, Gather(source.split), source.workers)
    if placement.split is not None and table.where[current].split != placement.split:
        current = convert(job, current, Scatter(placement.split), placement.workers)
    job.on_all(placement.workers, "alias", [out], [current], [0], {}, router.note(placement.workers, target, "reshard"))
    table.where[out], table.meta[out] = placement, (shape, dtype)
    router.add_crossings(table, out, table.crossings.get(current, frozenset()))
    if crossing is not None:
        table.direct[out] = crossing


def _backward_layout(table, name: str, backward: str | None, source, shape) -> int | None:
    """The axis a tensor moved into signal `name` has its gradient travel back split along (as
    its `backward` signal says, when that signal is on the workers the tensor comes from)."""
    if backward is None:
        return None
    layout = table.signals.get(backward)
    if layout is None or not layout.places:  # registration is order-free, so a dangling name is found here, at first use
        raise Refused(f"signal {name}: its backward signal {backward[:64]!r} is not in this "
                      "client's configuration (or places nothing)")
    if layout.workers != source.workers:  # it says where the region's backward runs (twins.py), not this
        return None
    return signal_placement(layout, shape).split

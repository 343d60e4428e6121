"""A region whose backward runs on other workers than its forward: a signal whose `backward:`
names a signal on other workers (GT's pipeline recipe: "forward on [0, 1], backward on [2, 3]").

Autograd's graph lives on the workers that ran the forward, with the tensors it saved, so the
backward's workers must build one of their own. Every differentiable operation issued in such a
region therefore runs twice: on the region's workers, giving the values the program sees, whose
results are then cut loose from the graph as leaves (`twin_copy`); and again, as its *twin*, on
the backward signal's workers laid out as that signal says, with a graph (`twin_source`). A
twin's inputs are the twins of earlier results of the region, or tensors moved there by
ordinary crossings (moves.py). A result and its twin are tied by a crossing of kind twin: in
backward, the gradient the result received goes to the twin's workers (each takes the whole
gradient, assembled from the result's parts when it is split), they run the region's backward,
and the gradients of the region's inputs travel back through the moves that brought them, as
for any crossing.

The price: the region's forward computed twice (what recomputing activations costs, paid in
forward rather than in backward), and its activations held on the backward signal's workers.
A result made in such a region keeps no `.grad` on the client (its gradient went to the twin).
"""

from __future__ import annotations

from paratrain.frontend.dispatcher.sharding import Placement
from paratrain.frontend.dispatcher.table import Crossing, Refused
from paratrain.frontend.ops import FLOATING, OPS
from paratrain.frontend.protocol import Instruction

def backward_elsewhere(table, instruction: Instruction, signal):
    """The backward signal of `instruction`'s region, when that signal places its work on other
    workers than the region's own; else None (backward runs where the forward did)."""
    if signal is None or signal.backward is None or instruction.no_grad or not OPS[instruction.op].differentiable:
        return None
    backward = table.signals.get(signal.backward)
    if backward is None or not backward.places:  # registration is order-free: a dangling name is found at first use
        raise Refused(f"signal {signal.name}: its backward signal {signal.backward[:64]!r} is not in this "
                      "client's configuration (or places nothing)")
    return backward if backward.workers != signal.workers else None


def twin_instruction(job, instruction: Instruction, backward) -> Instruction:
    """`instruction` again, for the backward signal's workers: on the twins of the inputs that
    have one there, with new (temporary, kept) handles for its results."""
    table = job.table
    args = list(instruction.args)
    for i in instruction.targs:
        twin = table.twins.get(args[i])
        if twin is not None and twin[0] == backward.name:
            args[i] = twin[1]
    outs = [job.temp(Placement(backward.workers, None), None, keep=True) for _ in instruction.outs]
    return instruction._replace(outs=outs, args=args, signal=backward.name)


def tie(job, instruction: Instruction, twin: Instruction, backward) -> None:
    """Tie each floating result to its twin by a crossing of kind twin (see the module's text)."""
    table, router = job.table, job.router
    for out, twin_out in zip(instruction.outs, twin.outs):
        if table.meta[out][1] not in FLOATING:
            _free(job, twin_out)
            continue
        copies, sources = table.where[out], table.where[twin_out]
        crossing = Crossing(sources.workers, copies.workers, twin=(copies.split, sources.split))
        crossing_id = router.new_crossing(job, crossing)
        job.on_all(copies.workers, "twin_copy", [], [out], [0], {"crossing": crossing_id}, "cut loose: backward elsewhere")
        job.on_all(sources.workers, "twin_source", [], [twin_out], [0], {"crossing": crossing_id},
                   f"twin of h{out}")
        table.twins[out] = (backward.name, twin_out)
        router.add_crossings(table, out, table.crossings.get(twin_out, frozenset()) | {crossing_id})


def emit_backward(job, crossing_id: int, crossing, keep_graph: bool) -> None:
    """The gradient of a twin's copies to the twin's workers, and backward from the twin there."""
    copy_split, twin_split = crossing.twin
    copies, twins = crossing.dst, crossing.src
    if copy_split is None:  # every copy's gradient is whole: each twin worker hears from one copy
        senders = {b: [copies[j % len(copies)]] for j, b in enumerate(twins)}
    else:  # the copies hold parts: each twin worker assembles the whole from all of them
        senders = {b: list(copies) for b in twins}
    for a in copies:
        to = [b for b in twins if a in senders[b]]
        job.emit(a, Instruction(job.seq, "twin_bw_send", [], [], [], {"crossing": crossing_id, "to": to}))
    for index, b in enumerate(twins):
        part = None if twin_split is None else [index, len(twins), twin_split]
        kwargs = {"crossing": crossing_id, "src": senders[b], "axis": copy_split, "part": part, "retain": keep_graph}
        job.emit(b, Instruction(job.seq, "twin_bw_recv", [], [], [], kwargs))


def forget(job, handle: int) -> None:
    """`handle` no longer equals its twin (it changed in place, or was freed): free the twin."""
    twin = job.table.twins.pop(handle, None)
    if twin is not None:
        _free(job, twin[1])


def _free(job, handle: int) -> None:
    placement = job.table.where.pop(handle, None)
    job.table.meta.pop(handle, None)
    job.table.crossings.pop(handle, None)
    for worker in placement.workers if placement is not None else ():
        if job.router.is_alive(worker):
            job.emit(worker, Instruction(job.seq, "free", [], [handle], [], {}))

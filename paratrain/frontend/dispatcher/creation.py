"""Where new tensors go: created by an operation (randn, zeros...) or uploaded by the client.

A tensor created in a signal's region is split or replicated over its workers as the signal
says; outside any region it goes to `gt.worker(k)`'s worker, or is split over every worker if
it is large and the dispatcher auto-shards (`auto_shard.py`), or to the client's home worker. Split
tensors are created part by part on their workers (uploads are cut by the dispatcher); a random
tensor replicated over several workers is drawn once and broadcast, so its copies agree.
"""

from __future__ import annotations

import numpy as np

from paratrain.frontend.dispatcher.conversions import ensure_group
from paratrain.frontend.dispatcher.sharding import Placement, local_shapes
from paratrain.frontend.dispatcher.table import Refused
from paratrain.frontend.ops import OPS
from paratrain.frontend.protocol import Instruction
from paratrain.frontend.protocol.tensors import NUMPY_DTYPES

def create(job, instruction: Instruction) -> None:
    """randn, zeros, arange...: made where the client's placement says, part by part if split."""
    router, table = job.router, job.table
    name, out = instruction.op, instruction.outs[0]
    (meta,) = router.infer(table, name, instruction.args, [], instruction.kwargs)
    signal = router.signal_of(table, instruction)
    placement = _placement_for(job, instruction, signal, meta)
    note = _note(router, placement, signal)
    if placement.split is not None:
        if OPS[name].created_whole:
            raise Refused(f"{name}: a split signal cannot create it (create it replicated, then gt.signal.tensor)")
        for worker, local in zip(placement.workers, local_shapes(meta[0], placement)):
            job.emit(worker, instruction._replace(args=list(local)), note)
    elif OPS[name].random and len(placement.workers) > 1:
        # Drawn once and broadcast: replicas must hold the same values.
        ensure_group(job, placement.workers)
        job.emit(placement.workers[0], instruction._replace(requires_grad=False), note)
        job.on_all(placement.workers, "tp_broadcast", [out], [], [],
                   {"g": list(placement.workers), "shape": list(meta[0]), "dtype": meta[1]},
                   "broadcast: replicas draw once", requires_grad=instruction.requires_grad)
    else:
        for worker in placement.workers:
            job.emit(worker, instruction, note)
    table.where[out], table.meta[out] = placement, meta


def upload(job, instruction: Instruction) -> None:
    """A tensor from the client's bytes (the protocol checked that the frame holds them)."""
    router, table = job.router, job.table
    out, kwargs = instruction.outs[0], instruction.kwargs
    shape, dtype = tuple(kwargs["shape"]), kwargs["dtype"]
    router.check_size(shape, dtype)
    signal = router.signal_of(table, instruction)
    placement = _placement_for(job, instruction, signal, (shape, dtype))
    note = _note(router, placement, signal)
    frame = job.frames[kwargs["frame"]]
    pieces, shapes = [frame] * len(placement.workers), [shape] * len(placement.workers)
    if placement.split is not None:
        array = np.frombuffer(frame, dtype=NUMPY_DTYPES[dtype]).reshape(shape)
        parts = np.array_split(array, len(placement.workers), axis=placement.split)
        pieces = [np.ascontiguousarray(part).tobytes() for part in parts]
        shapes = [part.shape for part in parts]
    for worker, piece, local in zip(placement.workers, pieces, shapes):
        job.emit(worker, instruction._replace(kwargs={**kwargs, "shape": list(local)}), note, frame=piece)
    table.where[out], table.meta[out] = placement, (shape, dtype)


def _note(router, placement: Placement, signal) -> str:
    """For the instruction log: the layout, and that auto-sharding chose it."""
    if len(placement.workers) == 1:
        return router.note(placement.workers, signal, "")
    chosen_by = "auto-shard " if signal is None and placement.split is not None else ""
    return router.note(placement.workers, signal, f"{chosen_by}-> {placement.describe()}")


def _placement_for(job, instruction: Instruction, signal, meta) -> Placement:
    router = job.router
    if signal is not None:
        placement = signal_placement(signal, meta[0])
    elif instruction.worker is not None:
        if instruction.worker >= router.n_workers:
            raise Refused(f"worker {instruction.worker} does not exist (there are {router.n_workers})")
        placement = Placement((instruction.worker,))
    else:
        placement = _auto_placement(router, instruction.op, meta) or Placement((job.table.home,))
    router.check_alive(placement.workers)
    return placement


def _auto_placement(router, name: str, meta) -> Placement | None:
    if router.auto_shard is None or OPS[name].created_whole:
        return None
    return router.auto_shard.placement(meta[0], meta[1], router.live_workers())


def signal_placement(signal, shape) -> Placement:
    """Where a tensor of `shape` created in `signal`'s region lives."""
    if signal.axis is None or len(signal.workers) == 1:
        return Placement(signal.workers)
    if not -len(shape) <= signal.axis < len(shape):
        raise Refused(f"signal {signal.name}: axis {signal.axis} is out of range for a tensor of shape {list(shape)}")
    return Placement(signal.workers, signal.axis % len(shape))

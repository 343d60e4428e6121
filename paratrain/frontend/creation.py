"""Where new tensors go: created by an operation (randn, zeros...) or uploaded by the client.

A tensor created in a signal's region is split or replicated over its workers as the signal
says; outside any region it goes to `gt.worker(k)`'s worker or the client's home worker. Split
tensors are created part by part on their workers (uploads are cut by the dispatcher); a random
tensor replicated over several workers is drawn once and broadcast, so its copies agree.
"""

from __future__ import annotations

import numpy as np

from paratrain.frontend.jobs import Refused
from paratrain.frontend.sharding import Placement, local_shapes
from paratrain.frontend.wire import NUMPY_DTYPES

RANDOM_CREATION = frozenset({"randn", "rand", "uniform", "randint"})


class CreationRoutes:
    """Mixed into Router."""

    def _create(self, job, name, outs, args, kwargs, flags, signal, frames, stream_frames) -> None:
        table = job.table
        if name == "upload":
            meta = (tuple(kwargs.get("shape") or ()), kwargs.get("dtype"))
            if meta[1] not in NUMPY_DTYPES or not all(isinstance(s, int) and s >= 0 for s in meta[0]):
                raise Refused("upload: dtype or shape is malformed")
        else:
            (meta,) = self._infer(table, name, args, [], kwargs)
        placement = self._placement_for(job.table, flags, signal, meta[0])
        self._check_alive(placement.workers)
        table.meta[outs[0]] = meta
        flags_out = {**(job.flags or {}), **({"rg": 1} if flags.get("rg") else {})} or None
        note = self._note(placement.workers, signal, f"-> {placement.describe()}" if len(placement.workers) > 1 else "")
        if name == "upload":
            self._upload(job, outs[0], kwargs, flags_out, placement, frames, stream_frames, note)
        elif placement.split is not None:
            if name == "arange":
                raise Refused("arange: a split signal cannot create it (create it replicated, then gt.signal.tensor)")
            for worker, local in zip(placement.workers, local_shapes(meta[0], placement)):
                job.emit(worker, [job.seq, name, list(outs), list(local), [], dict(kwargs), flags_out], note)
        elif name in RANDOM_CREATION and len(placement.workers) > 1:
            # Drawn once and broadcast: replicas must hold the same values.
            self._ensure_group(job, placement.workers)
            job.emit(placement.workers[0], [job.seq, name, list(outs), list(args), [], dict(kwargs), job.flags], note)
            job.on_all(placement.workers, "tp_broadcast", outs, [], [],
                       {"g": list(placement.workers), "shape": list(meta[0]), "dtype": meta[1]},
                       "broadcast: replicas draw once", flags_out)
        else:
            job.on_all(placement.workers, name, outs, args, [], kwargs, note, flags_out)
        table.where[outs[0]], table.meta[outs[0]] = placement, meta

    def _placement_for(self, table, flags, signal, shape) -> Placement:
        if signal is not None:
            return signal_placement(signal, shape)
        worker = flags.get("w")
        if worker is None:
            return Placement((table.home,))
        if not isinstance(worker, int) or not 0 <= worker < self.n_workers:
            raise Refused(f"worker {worker!r} does not exist (there are {self.n_workers})")
        return Placement((worker,))

    def _upload(self, job, handle, kwargs, flags, placement, frames, stream_frames, note) -> None:
        frame = kwargs.get("frame")
        if not isinstance(frame, int) or not 0 <= frame < len(frames):
            raise Refused(f"upload: frame {frame!r} is not among the message's {len(frames)} tensor frames")
        shape = tuple(kwargs["shape"])
        pieces = [frames[frame]] * len(placement.workers)
        shapes = [shape] * len(placement.workers)
        if placement.split is not None:
            array = np.frombuffer(frames[frame], dtype=NUMPY_DTYPES[kwargs["dtype"]]).reshape(shape)
            parts = np.array_split(array, len(placement.workers), axis=placement.split)
            pieces = [np.ascontiguousarray(part).tobytes() for part in parts]
            shapes = [part.shape for part in parts]
        for worker, piece, local in zip(placement.workers, pieces, shapes):
            stream_frames[worker].append(piece)
            local_kwargs = {**kwargs, "shape": list(local), "frame": len(stream_frames[worker]) - 1}
            job.emit(worker, [job.seq, "upload", [handle], [], [], local_kwargs, flags], note)


def signal_placement(signal, shape) -> Placement:
    """Where a tensor of `shape` created in `signal`'s region lives."""
    if signal.axis is None or len(signal.workers) == 1:
        return Placement(signal.workers)
    if not -len(shape) <= signal.axis < len(shape):
        raise Refused(f"signal {signal.name}: axis {signal.axis} is out of range for a tensor of shape {list(shape)}")
    return Placement(signal.workers, signal.axis % len(shape))

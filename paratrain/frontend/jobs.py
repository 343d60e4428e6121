"""The dispatcher's state for one client, and for one instruction while it is being routed."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from paratrain.frontend.sharding import Placement

MAX_HANDLE = 1 << 31  # client handles live below this; the router's temporaries above


class Refused(Exception):
    """The dispatcher will not run this instruction; the text says why."""


class MetaTensor:
    """A tensor as shape inference sees it: a shape and a dtype."""

    _handle = 0

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


@dataclass
class ClientTable:
    """What the dispatcher knows of one client's tensors."""

    slot: int
    home: int
    where: dict = field(default_factory=dict)  # handle -> Placement
    meta: dict = field(default_factory=dict)  # handle -> (global shape, dtype); None for optimizers
    crossings: dict = field(default_factory=dict)  # handle -> frozenset of crossing ids in its graph
    direct: dict = field(default_factory=dict)  # handle -> the crossing that made it (gt.signal.tensor)
    refused: dict = field(default_factory=dict)  # handle -> why its instruction was refused
    signals: dict = field(default_factory=dict)  # name -> Signal
    entered: dict = field(default_factory=dict)  # (handle, workers) -> its f(handle), until a backward
    next_temp: int = MAX_HANDLE


class Job:
    """One instruction being routed: where its pieces go, and the temporaries it made."""

    def __init__(self, router, table, seq, streams, no_grad):
        self.router, self.table, self.seq, self.streams = router, table, seq, streams
        self.flags = {"ng": 1} if no_grad else None
        self.temps: list[int] = []

    def emit(self, worker: int, instr: list, note: str = "") -> None:
        self.router.emit(self.streams, worker, instr, self.table, note)

    def on_all(self, workers, name, outs, args, targs, kwargs, note="", flags=None) -> None:
        """The same instruction on each of `workers` (its parts are shared: nothing changes them
        once emitted, and each worker's copy is encoded separately)."""
        flags = flags if flags is not None else self.flags
        outs, args, targs = list(outs), list(args), list(targs)
        for worker in workers:
            self.emit(worker, [self.seq, name, outs, args, targs, kwargs, flags], note)

    def temp(self, placement: Placement, meta, keep: bool = False) -> int:
        """A handle for an intermediate tensor, freed after this instruction unless `keep`."""
        handle = self.table.next_temp
        self.table.next_temp += 1
        self.table.where[handle], self.table.meta[handle] = placement, meta
        if not keep:
            self.temps.append(handle)
        return handle

    def free_temps(self) -> None:
        """One free per worker for all the temporaries this instruction made there."""
        by_worker = defaultdict(list)
        for handle in self.temps:
            placement = self.table.where.pop(handle)
            self.table.meta.pop(handle, None)
            self.table.crossings.pop(handle, None)
            for worker in placement.workers:
                by_worker[worker].append(handle)
        for worker, handles in by_worker.items():
            if self.router.is_alive(worker):
                self.emit(worker, [self.seq, "free", [], handles, [], {}, None])




def union_of(sets) -> frozenset:
    """The union of some crossing sets, most of them empty (None)."""
    found = frozenset()
    for crossings in sets:
        if crossings:
            found = found | crossings if found else crossings
    return found

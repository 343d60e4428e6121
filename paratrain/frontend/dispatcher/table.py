"""The dispatcher's state for one client, and for one instruction while it is being routed.

A `Job` buffers everything routing one instruction emits (instructions per worker, upload
frames, new process groups, new temporaries) and hands it over only when the whole instruction
routed: an instruction refused halfway leaves no half of itself in any worker's stream, which
would otherwise wait forever for a partner that never comes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from paratrain.frontend.dispatcher.sharding import Placement
from paratrain.frontend.protocol import CLIENT_HANDLES, Instruction


class Refused(Exception):
    """The dispatcher will not run this instruction; the text says why."""


@dataclass
class OpenRegion:
    """A compiled region the client is in (see regions.py)."""

    name: str
    began: set = field(default_factory=set)  # workers told that it began

    def opening(self, worker: int, seq: int) -> Instruction | None:
        """The begin marker a worker needs before its first instruction of the region (None
        once it has had it)."""
        if worker in self.began:
            return None
        self.began.add(worker)
        return Instruction(seq, "region_begin", [], [], [], {"name": self.name}, signal=self.name)


@dataclass
class Crossing:
    src: tuple[int, ...]  # the workers that sent (a replicated tensor)
    dst: tuple[int, ...]  # the workers that received a copy
    grad_split: int | None = None  # with a backward layout: the axis the gradient travels split along
    length: int = 0  # that axis' length
    refs: int = 0  # live client handles whose graph goes through it
    twin: tuple | None = None  # a twin's tie (twins.py): (the copies' split axis, the twin's)

    def forward_pairs(self) -> list[tuple[int, int]]:
        """(sender, receiver): each receiver gets one copy, from itself if it holds one."""
        return [(b if b in self.src else self.src[j % len(self.src)], b) for j, b in enumerate(self.dst)]

    def backward_pairs(self) -> list[tuple[int, int, int]]:
        """(gradient sender, receiver, part index): each original sender gets its gradient,
        from its own copy if it received one."""
        return [(a if a in self.dst else self.dst[i % len(self.dst)], a, i) for i, a in enumerate(self.src)]


@dataclass
class ClientTable:
    """What the dispatcher knows of one client's tensors."""

    slot: int
    home: int
    where: dict = field(default_factory=dict)  # handle -> Placement
    meta: dict = field(default_factory=dict)  # handle -> (global shape, dtype); None for optimizers
    crossings: dict = field(default_factory=dict)  # handle -> frozenset of crossing ids in its graph
    direct: dict = field(default_factory=dict)  # handle -> the crossing that made it (gt.signal.tensor)
    twins: dict = field(default_factory=dict)  # handle -> (backward signal, its twin's handle) (twins.py)
    refused: dict = field(default_factory=dict)  # handle -> why its instruction was refused
    signals: dict = field(default_factory=dict)  # name -> Signal
    entered: dict = field(default_factory=dict)  # (handle, workers) -> its f(handle), until a backward
    region: OpenRegion | None = None  # the compiled region open in this client's stream (regions.py)
    next_temp: int = CLIENT_HANDLES


@dataclass
class Routed:
    """A batch routed: each worker's instructions and upload frames, and the refusals."""

    streams: dict = field(default_factory=lambda: defaultdict(list))  # worker -> [Instruction]
    frames: dict = field(default_factory=lambda: defaultdict(list))  # worker -> [bytes]
    errors: list = field(default_factory=list)  # ErrorReport


class Job:
    """One instruction being routed: where its pieces go, and the temporaries it made."""

    def __init__(self, router, table: ClientTable, instruction: Instruction):
        self.router, self.table, self.instruction = router, table, instruction
        self.seq, self.no_grad = instruction.seq, instruction.no_grad
        self.emitted: list[tuple[int, Instruction, str, object]] = []  # (worker, instruction, note, frame)
        self.temps: list[int] = []
        self.made: list[int] = []  # every temporary, freed or kept, to forget if this job fails
        self.new_groups: list[tuple] = []
        self.new_entered: list[tuple] = []
        self.new_crossings: list[int] = []

    def emit(self, worker: int, instruction: Instruction, note: str = "", frame=None) -> None:
        self.emitted.append((worker, instruction, note, frame))

    def on_all(self, workers, name, outs, args, targs, kwargs, note="", requires_grad=False) -> None:
        """The same instruction on each of `workers`."""
        instruction = Instruction(self.seq, name, list(outs), list(args), list(targs), kwargs, self.no_grad,
                                  requires_grad)
        for worker in workers:
            self.emit(worker, instruction, note)

    def temp(self, placement: Placement, meta, keep: bool = False) -> int:
        """A handle for an intermediate tensor, freed after this instruction unless `keep`."""
        handle = self.table.next_temp
        self.table.next_temp += 1
        self.table.where[handle], self.table.meta[handle] = placement, meta
        self.made.append(handle)
        if not keep:
            self.temps.append(handle)
        return handle

    def free_temps(self) -> None:
        """One free per worker for all the temporaries this instruction made there."""
        if not self.temps:
            return
        by_worker = defaultdict(list)
        for handle in self.temps:
            placement = self.table.where.pop(handle)
            self.table.meta.pop(handle, None)
            self.table.crossings.pop(handle, None)
            for worker in placement.workers:
                by_worker[worker].append(handle)
        for worker, handles in by_worker.items():
            if self.router.is_alive(worker):
                self.emit(worker, Instruction(self.seq, "free", [], handles, [], {}))
        self.temps = []

    def commit(self, routed: Routed, log) -> None:
        """Hand what this instruction emitted over to the batch (numbering log lines and frames)."""
        self.router.groups.update(self.new_groups)
        region = self.table.region
        for worker, instruction, note, frame in self.emitted:
            if region is not None and instruction.op != "region_end":
                marker = region.opening(worker, self.seq)
                if marker is not None:
                    if log is not None:
                        marker = marker._replace(log=log.describe(worker, marker, self.table, region.name))
                    routed.streams[worker].append(marker)
            if frame is not None:
                instruction = instruction._replace(kwargs={**instruction.kwargs, "frame": len(routed.frames[worker])})
                routed.frames[worker].append(frame)
            if log is not None:
                instruction = instruction._replace(log=log.describe(worker, instruction, self.table, note))
            routed.streams[worker].append(instruction)

    def abandon(self) -> None:
        """Forget what this instruction made: it was refused, and nothing of it will run."""
        for handle in self.made:
            self.table.where.pop(handle, None)
            self.table.meta.pop(handle, None)
            self.table.crossings.pop(handle, None)
        for key in self.new_entered:
            self.table.entered.pop(key, None)
        for crossing in self.new_crossings:
            self.router.crossings.pop(crossing, None)


def union_of(sets) -> frozenset:
    """The union of some crossing sets, most of them empty (None)."""
    found = frozenset()
    for crossings in sets:
        if crossings:
            found = found | crossings if found else crossings
    return found

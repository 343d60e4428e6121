"""From one client's instructions to work for each worker.

For every instruction the router checks what the protocol cannot (handles this client owns,
result handles not yet in use), infers its results' shapes itself (the same meta-tensor
inference the client runs: nothing a client claims about shapes is trusted), and hands it to
its handler, found in one table (`HANDLERS`), which decides where it runs:

- created tensors (`creation.py`) go where the client's signal says, or to `gt.worker(k)`, or
  (auto-sharding, `auto_shard.py`) split over every worker when large, or to the client's home
  worker;
- an operation on tensors (`compute.py`) runs on its signal's workers or where its first input
  (auto-sharding: its first split input) lives, moving and re-laying out inputs as needed (`moves.py`, `conversions.py`);
- `backward` of a loss whose graph crossed workers is the local backward followed by every
  crossing's gradient exchange, newest first (`moves.py`);
- frees, optimizers and seeds are bookkeeping, below;
- the markers of a compiled region go to the workers its instructions reach (`regions.py`).

Streams are built in one global order and each worker runs its own in order, so every send
meets its receive and every collective its partners. An instruction that cannot be routed is
refused whole (see `Job`); later instructions that use its results are skipped quietly.
"""

from __future__ import annotations

import traceback
from collections import defaultdict

from paratrain.frontend.dispatcher import compute, creation, moves, regions, twins
from paratrain.frontend.dispatcher.auto_shard import AutoShard
from paratrain.frontend.dispatcher.conversions import forget_entered
from paratrain.frontend.dispatcher.sharding import Placement
from paratrain.frontend.dispatcher.table import ClientTable, Crossing, Job, Refused, Routed
from paratrain.frontend.ops import HANDLE_LISTS, ITEM_SIZES, OPS
from paratrain.frontend.protocol import CLIENT_HANDLES, Instruction
from paratrain.frontend.protocol.records import ErrorReport
from paratrain.frontend.shapes import ShapeError, infer_from

__all__ = ["ClientTable", "Refused", "Router"]

# Shape inference has nothing to run for these: their result (if any) is the tensor itself.
AUTOGRAD_STATE = frozenset(name for name, op in OPS.items() if op.autograd_state)


class Skipped(Refused):
    """An input's own instruction was refused: skip this one without a second error."""


class Router:
    def __init__(self, n_workers: int, is_alive, log=None, max_tensor_bytes: int | None = None, warn=None,
                 auto_shard: AutoShard | None = None):
        self.n_workers = n_workers
        self.auto_shard = auto_shard  # None: tensors no one placed go to the client's home worker
        self.is_alive = is_alive  # worker -> bool
        self.log = log  # InstructionLog or None
        self.max_tensor_bytes = max_tensor_bytes
        self.warn = warn or (lambda text: None)  # where the router reports its own failures
        self.crossings: dict[int, Crossing] = {}
        self.next_crossing = 0
        self.groups: set[tuple] = set()  # worker sets that have a process group for collectives

    def route(self, table: ClientTable, instructions: list[Instruction], frames: list) -> Routed:
        routed = Routed()
        for instruction in instructions:
            job = Job(self, table, instruction)
            job.frames = frames
            try:
                self._check(table, instruction)
                HANDLERS[instruction.op](job, instruction)
                job.free_temps()
            except Refused as refusal:
                self._refuse(job, routed, str(refusal), report=not isinstance(refusal, Skipped))
                continue
            except Exception as error:  # noqa: BLE001 - a router bug costs this instruction, never the dispatcher
                self.warn(f"routing {instruction.op} (client {table.slot}) failed:\n{traceback.format_exc(limit=4)}")
                self._refuse(job, routed, f"the dispatcher could not route it ({type(error).__name__}: {error})")
                continue
            job.commit(routed, self.log)
        return routed

    def _refuse(self, job: Job, routed: Routed, cause: str, report: bool = True) -> None:
        job.abandon()
        for handle in job.instruction.outs:
            job.table.refused[handle] = cause
        if report:
            routed.errors.append(ErrorReport(job.seq, job.instruction.op, [], None, cause))

    def _check(self, table: ClientTable, instruction: Instruction) -> None:
        """What the protocol cannot check: whose handles these are."""
        if instruction.op in HANDLE_LISTS:
            return
        for handle in instruction.outs:
            if handle in table.where or handle in table.refused:
                raise Refused(f"{instruction.op}: result handle {handle} is already in use")
        for i in instruction.targs:
            handle = instruction.args[i]
            if handle in table.refused:
                raise Skipped(table.refused[handle])
            if handle not in table.where:
                raise Refused(f"{instruction.op}: handle {handle} is not a tensor of this client")

    # ---- what handlers ask of the router --------------------------------------------------

    def signal_of(self, table: ClientTable, instruction: Instruction):
        """The signal an instruction was issued under, if this client's configuration has it
        and it places anything (a signal that only compiles does not)."""
        if instruction.signal is None:
            return None
        signal = table.signals.get(instruction.signal)
        return signal if signal is not None and signal.places else None

    def infer(self, table: ClientTable, name: str, args: list, targs: list, kwargs: dict) -> list:
        """[(shape, dtype), ...] of the results of `name` on these arguments."""
        tensors = [table.meta[args[i]] for i in targs]
        if None in tensors:
            raise Refused(f"{name}: handle {args[targs[tensors.index(None)]]} is an optimizer, not a tensor")
        if name in AUTOGRAD_STATE:
            return [tensors[0]] if name == "grad" else []
        try:
            results = infer_from(name, args, targs, tensors, kwargs)
        except ShapeError as error:
            raise Refused(str(error)) from None
        if self.max_tensor_bytes is not None:
            for shape, dtype in results:
                self.check_size(shape, dtype)
        return results

    def check_size(self, shape, dtype: str) -> None:
        """Refuse a tensor over --max-tensor-mb."""
        if self.max_tensor_bytes is None:
            return
        count = 1
        for size in shape:
            count *= size
        if count * ITEM_SIZES[dtype] > self.max_tensor_bytes:
            raise Refused(f"a {dtype}{list(shape)} tensor is over this server's limit of "
                          f"{self.max_tensor_bytes >> 20} MiB per tensor (paratrain serve --max-tensor-mb)")

    def live_workers(self) -> tuple[int, ...]:
        return tuple(w for w in range(self.n_workers) if self.is_alive(w))

    def check_alive(self, workers) -> None:
        for worker in workers:
            if not self.is_alive(worker):
                raise Refused(f"worker {worker} is lost; tensors that lived there are gone")

    def note(self, workers, signal, pattern: str) -> str:
        """For the instruction log: the signal and what its layout made happen."""
        if self.log is None or (len(workers) == 1 and signal is None):
            return ""
        text = f"[{signal.name}] " if signal is not None else ""
        return text + (pattern or "")

    def new_crossing(self, job: Job, crossing) -> int:
        crossing_id = self.next_crossing
        self.next_crossing += 1
        self.crossings[crossing_id] = crossing
        job.new_crossings.append(crossing_id)
        return crossing_id

    def add_crossings(self, table: ClientTable, handle: int, crossed: frozenset) -> None:
        if not crossed:
            return
        before = table.crossings.get(handle, frozenset())
        if handle < CLIENT_HANDLES:  # only client handles keep a crossing alive
            for crossing in crossed - before:
                self.crossings[crossing].refs += 1
        table.crossings[handle] = before | crossed

    def release(self, crossings, job: Job) -> None:
        """Drop references to crossings; one no handle needs any more is released on its workers."""
        for crossing in crossings:
            link = self.crossings.get(crossing)
            if link is None:
                continue
            link.refs -= 1
            if link.refs <= 0:
                del self.crossings[crossing]
                for worker in set(link.src) | set(link.dst):
                    if self.is_alive(worker):
                        job.emit(worker, Instruction(job.seq, "release", [], [crossing], [], {}))

    def drop_client(self, table: ClientTable) -> Routed:
        """Release the crossings a departing client's graphs held; -> the release streams."""
        job = Job(self, table, Instruction(0, "free", [], [], [], {}))
        for crossings in table.crossings.values():
            self.release(crossings, job)
        table.crossings.clear()
        routed = Routed()
        job.commit(routed, None)
        return routed


# ---- the bookkeeping handlers ---------------------------------------------------------------------

def free(job: Job, instruction: Instruction) -> None:
    table = job.table
    handles = instruction.args
    if table.entered:
        forget_entered(job, set(handles))
    by_worker = {}
    for handle in handles:
        table.refused.pop(handle, None)
        table.meta.pop(handle, None)
        table.direct.pop(handle, None)
        if table.twins:
            twins.forget(job, handle)
        placement = table.where.pop(handle, None)
        if placement is not None:
            for worker in placement.workers:
                by_worker.setdefault(worker, []).append(handle)
        crossings = table.crossings.pop(handle, None)
        if crossings:
            job.router.release(crossings, job)
    for worker, owned in by_worker.items():
        if job.router.is_alive(worker):
            job.emit(worker, Instruction(job.seq, "free", [], owned, [], {}))


def keep_grads(job: Job, instruction: Instruction) -> None:
    """Results whose gradient backward keeps (GT's rule): each worker is told of those it holds."""
    by_worker = defaultdict(list)
    for handle in instruction.args:
        placement = job.table.where.get(handle)
        for worker in placement.workers if placement is not None else ():
            by_worker[worker].append(handle)
    for worker, held in by_worker.items():
        job.emit(worker, Instruction(job.seq, "keep_grads", [], held, [], {}))


def optim_create(job: Job, instruction: Instruction) -> None:
    """An optimizer on every worker that holds one of its parameters, over those it holds."""
    table = job.table
    by_worker = defaultdict(list)
    for i in instruction.targs:
        handle = instruction.args[i]
        if table.meta[handle] is None:
            raise Refused(f"optim_create: handle {handle} is an optimizer, not a tensor")
        for worker in table.where[handle].workers:
            by_worker[worker].append(handle)
    job.router.check_alive(by_worker)
    for worker, params in by_worker.items():
        job.emit(worker, Instruction(job.seq, "optim_create", list(instruction.outs), params,
                                     list(range(len(params))), dict(instruction.kwargs)))
    out = instruction.outs[0]
    table.where[out], table.meta[out] = Placement(tuple(by_worker)), None


def on_optimizer(job: Job, instruction: Instruction) -> None:
    """optimizer.step(), zero_grad(), its learning rate: on every worker it lives on."""
    handle = instruction.args[instruction.targs[0]]
    if job.table.meta[handle] is not None:
        raise Refused(f"{instruction.op}: handle {handle} is a tensor, not an optimizer")
    job.on_all(job.table.where[handle].workers, instruction.op, [], instruction.args, instruction.targs,
               instruction.kwargs)


def manual_seed(job: Job, instruction: Instruction) -> None:
    workers = [w for w in range(job.router.n_workers) if job.router.is_alive(w)]
    job.on_all(workers, "manual_seed", [], instruction.args, [], {})


def _forget_graphs_then(handler):
    """An f belongs to one forward: a backward or an optimizer step ends it."""
    def handle(job: Job, instruction: Instruction) -> None:
        forget_entered(job)
        handler(job, instruction)
    return handle


_SPECIAL = {
    "free": free, "keep_grads": keep_grads, "optim_create": _forget_graphs_then(optim_create), "manual_seed": manual_seed,
    "optim_step": _forget_graphs_then(on_optimizer), "optim_zero_grad": _forget_graphs_then(on_optimizer),
    "optim_set_lr": _forget_graphs_then(on_optimizer), "upload": creation.upload,
    "backward": _forget_graphs_then(moves.backward), "cross_backward": _forget_graphs_then(moves.cross_backward),
    "reshard": moves.reshard, "region_begin": regions.begin, "region_end": regions.end,
}
HANDLERS = {name: _SPECIAL.get(name) or (creation.create if op.kind == "create" else compute.compute)
            for name, op in OPS.items() if op.kind != "internal"}

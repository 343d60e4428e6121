"""From one client's instructions to work for each worker.

For every instruction the router checks it (a known operation, handles this client owns,
allowed arguments), decides where it runs, and appends it to that worker's stream:

- a created tensor goes to the worker the client's context names, or the client's home worker;
- any other operation runs where its first tensor input lives; inputs that live elsewhere are
  first moved there, worker to worker (`send` on one stream, `recv` on the other);
- `backward` of a loss whose graph crossed workers becomes the local backward followed by one
  gradient exchange per crossing (`bw_send` / `bw_recv`), newest crossing first.

Streams are built in one global order and each worker runs its own in order, so every `send`
meets its `recv` and no two workers ever wait for each other.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from paratrain.frontend.ops import OPS, validate_kwargs

MAX_HANDLE = 1 << 31  # client handles live below this; the router's temporaries above
CLIENT_FLAGS = frozenset({"ng", "w", "rg", "sh"})


class Refused(Exception):
    """The dispatcher will not run this instruction; the text says why."""


@dataclass
class Crossing:
    """A tensor sent from one worker to another, kept while a graph may still need its gradient."""

    src: int
    dst: int
    refs: int = 0  # live client handles whose autograd graph goes through it


@dataclass
class ClientTable:
    """What the dispatcher knows of one client's tensors."""

    slot: int
    home: int
    where: dict = field(default_factory=dict)  # handle -> tuple of workers
    crossings: dict = field(default_factory=dict)  # handle -> frozenset of crossing ids
    refused: dict = field(default_factory=dict)  # handle -> why its instruction was refused
    shapes: dict = field(default_factory=dict)  # handle -> "float32[4, 8]" (only when logging)
    next_temp: int = MAX_HANDLE


class Router:
    def __init__(self, n_workers: int, is_alive, log=None):
        self.n_workers = n_workers
        self.is_alive = is_alive  # worker -> bool
        self.log = log  # InstructionLog or None
        self.crossings: dict[int, Crossing] = {}
        self.next_crossing = 0

    def route(self, table: ClientTable, ops: list, frames: list):
        """-> ({worker: [instr, ...]}, {worker: [frame, ...]}, [error, ...])."""
        streams, stream_frames, errors = defaultdict(list), defaultdict(list), []
        for instr in ops:
            try:
                self._route_one(table, instr, streams, stream_frames, frames)
            except Refused as refusal:
                message = str(refusal)
                cause = message.removeprefix("(skipped) ")
                outs = instr[2] if _is_instruction(instr) and isinstance(instr[2], list) else []
                for handle in outs:
                    if isinstance(handle, int):
                        table.refused[handle] = cause
                if not message.startswith("(skipped)"):
                    seq = instr[0] if _is_instruction(instr) and isinstance(instr[0], int) else -1
                    name = str(instr[1])[:64] if _is_instruction(instr) else "?"
                    errors.append([seq, name, [], None, message])
        return streams, stream_frames, errors

    # ---- one instruction ----------------------------------------------------------------

    def _route_one(self, table, instr, streams, stream_frames, frames) -> None:
        seq, name, outs, args, targs, kwargs, flags = self._check(table, instr)
        shapes = flags.pop("sh", None) if flags else None
        if name == "free":
            self._free(table, seq, args, streams)
            return
        if name == "optim_create":
            self._optim_create(table, instr, streams)
            return
        op = OPS[name]
        inputs = [args[i] for i in targs]
        if name == "manual_seed":
            workers = tuple(w for w in range(self.n_workers) if self.is_alive(w))
        elif not inputs:  # a new tensor: where the client's context says
            workers = (self._target(flags, table),)
        else:
            workers = table.where[inputs[0]]
            if len(workers) > 1 and not name.startswith("optim_"):
                raise Refused(f"{name}: handle {inputs[0]} is an optimizer, not a tensor")
        for worker in workers:
            self._alive(worker)
        crossed = set()
        if inputs and not name.startswith("optim_"):
            target = workers[0]
            for i in targs[1:]:  # inputs that live elsewhere move to the target first
                crossed |= self._bring(table, seq, args, i, target, streams)
            for handle in inputs:
                crossed |= table.crossings.get(handle, frozenset())
        if name == "upload":
            frame = kwargs.get("frame")
            if not isinstance(frame, int) or not 0 <= frame < len(frames):
                raise Refused(f"upload: frame {frame!r} is not among the message's {len(frames)} tensor frames")
            stream_frames[workers[0]].append(frames[frame])
            kwargs["frame"] = len(stream_frames[workers[0]]) - 1
        if name == "backward":
            self._backward(seq, instr, workers[0], crossed, streams, table)
        else:
            for worker in workers:
                self._emit(streams, worker, instr, table, shapes)
        self._record_results(table, op, outs, args, targs, workers, crossed, shapes)
        temporaries = [args[i] for i in targs if args[i] >= MAX_HANDLE]
        if temporaries:  # copies brought for this instruction: free them right after it
            self._emit(streams, workers[0], [seq, "free", [], temporaries, [], {}, None], table)

    def _check(self, table: ClientTable, instr):
        if not _is_instruction(instr):
            raise Refused("an instruction must be a list [seq, op, outs, args, targs, kwargs, flags]")
        seq, name, outs, args, targs, kwargs, flags = instr
        if not isinstance(name, str) or name not in OPS:
            raise Refused(f"unknown operation {str(name)[:64]!r}")
        if not (isinstance(seq, int) and isinstance(outs, list) and isinstance(args, list)
                and isinstance(targs, list) and isinstance(kwargs, dict)
                and (flags is None or isinstance(flags, dict))):
            raise Refused(f"{name}: malformed instruction fields")
        if name == "free":
            if not all(isinstance(handle, int) for handle in args):
                raise Refused("free: handles must be ints")
            return seq, name, outs, args, targs, kwargs, flags
        reason = validate_kwargs(name, kwargs)
        if reason:
            raise Refused(reason)
        if flags and not set(flags) <= CLIENT_FLAGS:
            raise Refused(f"{name}: unknown flags {sorted(set(flags) - CLIENT_FLAGS)}")
        for handle in outs:
            if not isinstance(handle, int) or not 0 <= handle < MAX_HANDLE:
                raise Refused(f"{name}: result handle {handle!r} is not an int in [0, 2**31)")
            if handle in table.where or handle in table.refused:
                raise Refused(f"{name}: result handle {handle} is already in use")
        for i in targs:
            if not isinstance(i, int) or not 0 <= i < len(args):
                raise Refused(f"{name}: tensor position {i!r} is outside the arguments")
            handle = args[i]
            if handle in table.refused:
                raise Refused(f"(skipped) {table.refused[handle]}")
            if not isinstance(handle, int) or handle not in table.where:
                raise Refused(f"{name}: handle {handle!r} is not a tensor of this client")
        return seq, name, outs, args, targs, kwargs, flags

    def _target(self, flags, table: ClientTable) -> int:
        worker = flags.get("w") if flags else None
        if worker is None:
            return table.home
        if not isinstance(worker, int) or not 0 <= worker < self.n_workers:
            raise Refused(f"worker {worker!r} does not exist (there are {self.n_workers})")
        return worker

    def _alive(self, worker: int) -> None:
        if not self.is_alive(worker):
            raise Refused(f"worker {worker} is lost (no heartbeat); tensors that lived there are gone")

    # ---- moving tensors -----------------------------------------------------------------

    def _bring(self, table, seq, args, i, target, streams) -> set:
        handle = args[i]
        (source,) = table.where[handle][:1]
        if source == target:
            return set()
        self._alive(source)
        crossing = self.next_crossing
        self.next_crossing += 1
        self.crossings[crossing] = Crossing(source, target)
        temp = table.next_temp
        table.next_temp += 1
        self._emit(streams, source, [seq, "send", [], [handle], [0], {"to": target, "t": crossing}, None], table)
        self._emit(streams, target, [seq, "recv", [temp], [], [], {"src": source, "t": crossing}, None], table)
        args[i] = temp
        return {crossing}

    def _backward(self, seq, instr, worker, crossed, streams, table) -> None:
        if crossed:
            instr[6] = {**(instr[6] or {}), "retain": 1}  # later crossings traverse it again
        self._emit(streams, worker, instr, table)
        for crossing in sorted(crossed, reverse=True):
            link = self.crossings[crossing]
            self._emit(streams, link.dst, [seq, "bw_send", [], [], [], {"t": crossing, "to": link.src}, None], table)
            self._emit(streams, link.src, [seq, "bw_recv", [], [], [], {"t": crossing, "src": link.dst}, None], table)

    def _optim_create(self, table, instr, streams) -> None:
        seq, name, outs, args, targs, kwargs, flags = instr
        by_worker = defaultdict(list)
        for i in targs:
            by_worker[table.where[args[i]][0]].append(args[i])
        for worker, params in by_worker.items():
            self._alive(worker)
            self._emit(streams, worker, [seq, name, outs, params, list(range(len(params))), kwargs, flags], table)
        table.where[outs[0]] = tuple(by_worker) or (table.home,)

    # ---- bookkeeping ----------------------------------------------------------------------

    def _record_results(self, table, op, outs, args, targs, workers, crossed, shapes) -> None:
        crossed = frozenset(crossed)
        targets = list(outs)
        if op.kind == "inplace" and targs:
            targets.append(args[targs[0]])
        for handle in targets:
            table.where[handle] = workers
            if crossed:
                before = table.crossings.get(handle, frozenset())
                for crossing in crossed - before:
                    self.crossings[crossing].refs += 1
                table.crossings[handle] = before | crossed
        if shapes and self.log is not None:
            for handle, shape in zip(outs, shapes[1]):
                table.shapes[handle] = shape

    def _free(self, table, seq, handles, streams) -> None:
        by_worker = defaultdict(list)
        for handle in handles:
            table.refused.pop(handle, None)
            table.shapes.pop(handle, None)
            workers = table.where.pop(handle, ())
            for worker in workers:
                by_worker[worker].append(handle)
            self._unref(table.crossings.pop(handle, ()), streams)
        for worker, owned in by_worker.items():
            if self.is_alive(worker):
                self._emit(streams, worker, [seq, "free", [], owned, [], {}, None], table)

    def _unref(self, crossings, streams) -> None:
        for crossing in crossings:
            link = self.crossings[crossing]
            link.refs -= 1
            if link.refs <= 0:
                del self.crossings[crossing]
                for worker in {link.src, link.dst}:
                    if self.is_alive(worker):
                        streams[worker].append([-1, "release", [], [crossing], [], {}, None])

    def drop_client(self, table: ClientTable) -> dict:
        """Release the crossings a departing client's graphs held; -> release streams."""
        streams = defaultdict(list)
        for crossings in table.crossings.values():
            self._unref(crossings, streams)
        table.crossings.clear()
        return streams

    def _emit(self, streams, worker, instr, table, shapes=None) -> None:
        if self.log is not None:
            flags = instr[6] = dict(instr[6] or {})
            flags["L"] = self.log.describe(worker, instr, table, shapes)
        streams[worker].append(instr)


def _is_instruction(instr) -> bool:
    return isinstance(instr, list) and len(instr) == 7

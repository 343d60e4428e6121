"""From one client's instructions to work for each worker.

For every instruction the router checks it (a known operation, handles this client owns,
allowed arguments), infers its results' shapes itself (the same meta-tensor inference the
client runs: nothing a client claims about shapes is trusted), decides where it runs, and
appends it to each of those workers' streams:

- a created tensor goes where the client's signal says (split or replicated over its
  workers), or to `gt.worker(k)`, or to the client's home worker;
- any other operation runs on its signal's workers, or where its first tensor input lives;
  inputs that live elsewhere are moved there first (see `moves.py`), and inputs whose layout
  does not suit the operation change layout on the way (see `sharding.py`);
- `backward` of a loss whose graph crossed workers is the local backward followed by every
  crossing's gradient exchange, newest first; a pipeline issues them stage by stage instead.

Streams are built in one global order and each worker runs its own in order, so every send
meets its receive and every collective its partners.
"""

from __future__ import annotations

from collections import defaultdict

from paratrain.frontend.client.shapes import ShapeError, infer
from paratrain.frontend.creation import CreationRoutes
from paratrain.frontend.jobs import MAX_HANDLE, ClientTable, Job, MetaTensor, Refused, union_of
from paratrain.frontend.moves import Crossing, MoveRoutes
from paratrain.frontend.ops import OPS, validate_kwargs
from paratrain.frontend.sharding import Placement, Unsupported, plan

__all__ = ["MAX_HANDLE", "ClientTable", "Refused", "Router"]

CLIENT_FLAGS = frozenset({"ng", "w", "rg", "s"})
# These run where their first input lives, whatever signal is active: they act on it in place.
STAY = frozenset({"grad", "set_grad_none", "set_grad", "requires_grad_", "set_data", "detach"}) | {
    name for name, op in OPS.items() if op.kind == "inplace"}


class Router(CreationRoutes, MoveRoutes):
    def __init__(self, n_workers: int, is_alive, log=None):
        self.n_workers = n_workers
        self.is_alive = is_alive  # worker -> bool
        self.log = log  # InstructionLog or None
        self.crossings: dict[int, Crossing] = {}
        self.next_crossing = 0
        self.groups: set[tuple] = set()  # worker sets that have a process group for collectives

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
        flags = flags or {}
        job = Job(self, table, seq, streams, bool(flags.get("ng")))
        if name == "free":
            self._free(job, args)
            job.free_temps()
            return
        signal = table.signals.get(flags.get("s")) if flags.get("s") is not None else None
        if name in ("backward", "cross_backward") or name.startswith("optim_"):
            self._forget_entered(job)  # an f belongs to one forward: never across a backward
        try:
            if name == "optim_create":
                self._optim_create(job, outs, args, targs, kwargs)
            elif name in ("optim_step", "optim_zero_grad", "optim_set_lr"):
                job.on_all(table.where[args[0]].workers, name, outs, args, targs, kwargs)
            elif name == "manual_seed":
                job.on_all([w for w in range(self.n_workers) if self.is_alive(w)], name, outs, args, targs, kwargs)
            elif not targs:
                self._create(job, name, outs, args, kwargs, flags, signal, frames, stream_frames)
            elif name == "backward":
                self._backward(job, args, targs, kwargs)
            elif name == "cross_backward":
                self._cross_backward(job, args[0])
            elif name == "reshard":
                self._reshard(job, outs[0], args[0], kwargs)
            else:
                self._compute(job, name, outs, args, targs, kwargs, signal)
        finally:
            job.free_temps()

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

    # ---- operations on tensors ------------------------------------------------------------

    def _compute(self, job, name, outs, args, targs, kwargs, signal) -> None:
        table = job.table
        first = table.where[args[targs[0]]]
        workers = first.workers if signal is None or name in STAY else signal.workers
        self._check_alive(workers)
        if len(workers) == 1 and all(table.where[args[i]] is first or table.where[args[i]] == first for i in targs):
            self._compute_here(job, name, outs, args, targs, kwargs, first)  # the common case
            return
        for i in targs:
            if table.where[args[i]].workers != workers:
                if OPS[name].kind == "inplace" and i == targs[0]:
                    raise Refused(f"{name}: the tensor changed in place lives on other workers")
                args[i] = self._move(job, args[i], workers)
        out_metas = self._infer(table, name, args, targs, kwargs)
        if OPS[name].kind != "inplace":
            table.meta.update(zip(outs, out_metas))  # known before emitting: the log shows them
        shapes = {i: table.meta[args[i]][0] for i in targs}
        splits = {i: table.where[args[i]].split for i in targs}
        try:
            steps = plan(name, args, targs, kwargs, shapes, splits, [m[0] for m in out_metas], len(workers))
        except Unsupported as error:
            raise Refused(f"{name}: {error}") from None
        inputs = list(args)  # the handles as they were, for steps after the operation
        for i, conversion in steps.convert.items():
            args[i] = self._convert(job, args[i], conversion, workers)
        op_args = list(args) + [None] * max(0, max(steps.args, default=-1) + 1 - len(args))
        for position, value in steps.args.items():
            op_args[position] = value
        op_targs = [i for i in targs if i not in steps.args]
        op_kwargs = dict(steps.kwargs) if steps.replace_kwargs else {**kwargs, **steps.kwargs}
        op_name = steps.op or name
        if op_name.startswith("vp_"):
            self._ensure_group(job, workers)
            op_kwargs["g"] = list(workers)
        placement_note = ""
        if self.log is not None:
            layout = f"-> {Placement(workers, steps.outs[0]).describe()}" if steps.outs and len(workers) > 1 else ""
            placement_note = self._note(workers, signal, f"{steps.note} {layout}".strip())
        results = list(outs) if not steps.post else [job.temp(Placement(workers, None), out_metas[0])]
        job.on_all(workers, op_name, results, op_args, op_targs, op_kwargs, placement_note)
        if steps.post:
            self._post(job, steps.post, results[0], outs[0], inputs, workers, out_metas[0])
        crossed = union_of(table.crossings.get(args[i]) for i in targs)
        targets = list(outs) if OPS[name].kind != "inplace" else [inputs[targs[0]]]
        splits_out = steps.outs if OPS[name].kind != "inplace" else [table.where[inputs[targs[0]]].split]
        for handle, meta, split in zip(targets, out_metas, splits_out):
            if OPS[name].kind != "inplace":
                table.where[handle], table.meta[handle] = Placement(workers, split), meta
            self._add_crossings(table, handle, crossed)

    def _compute_here(self, job, name, outs, args, targs, kwargs, placement) -> None:
        """Everything on one worker: the instruction goes there as the client wrote it."""
        table = job.table
        out_metas = self._infer(table, name, args, targs, kwargs)
        inplace = OPS[name].kind == "inplace"
        if not inplace:
            for handle, meta in zip(outs, out_metas):
                table.where[handle], table.meta[handle] = placement, meta
        job.emit(placement.workers[0], [job.seq, name, outs, args, targs, kwargs, job.flags])
        crossed = union_of(table.crossings.get(args[i]) for i in targs)
        if crossed:
            for handle in ([args[targs[0]]] if inplace else outs):
                self._add_crossings(table, handle, crossed)

    def _post(self, job, post, current, final, inputs, workers, meta) -> None:
        """The steps after a partial result: all-reduce, scale, add a bias."""
        self._ensure_group(job, workers)
        for index, step in enumerate(post):
            last = index == len(post) - 1
            target = final if last else job.temp(Placement(workers, None), meta)
            if step[0] == "g":
                job.on_all(workers, "tp_g", [target], [current], [0], {"g": list(workers)}, "all-reduce")
            elif step[0] == "scale":
                job.on_all(workers, "mul", [target], [current, step[1]], [0], {})
            else:
                job.on_all(workers, "add", [target], [current, inputs[step[1]]], [0, 1], {})
            current = target

    def _convert(self, job, handle, conversion, workers) -> int:
        """A temporary copy of `handle` in the layout `conversion` asks for, on `workers`."""
        table = job.table
        meta = table.meta[handle]
        self._ensure_group(job, workers)
        group = list(workers)
        if conversion[0] == "f":
            # One f per tensor and forward: its consumers (Q, K and V of one input) then share
            # one all-reduce in backward, as Megatron's fused QKV does.
            key = (handle, tuple(workers))
            if key in table.entered:
                return table.entered[key]
            temp = job.temp(Placement(workers, None), meta, keep=True)
            table.entered[key] = temp
            job.on_all(workers, "tp_f", [temp], [handle], [0], {"g": group}, "f: all-reduce in backward")
        elif conversion[0] == "scatter":
            temp = job.temp(Placement(workers, conversion[1]), meta)
            job.on_all(workers, "tp_scatter", [temp], [handle], [0], {"g": group, "axis": conversion[1]},
                       f"scatter along {conversion[1]}")
        else:
            axis = conversion[1]
            temp = job.temp(Placement(workers, None), meta)
            job.on_all(workers, "tp_gather", [temp], [handle], [0],
                       {"g": group, "axis": axis, "length": meta[0][axis]}, f"all-gather along {axis}")
        table.crossings[temp] = table.crossings.get(handle, frozenset())
        return temp

    def _infer(self, table, name, args, targs, kwargs) -> list:
        metas = list(args)
        for i in targs:
            meta = table.meta[args[i]]
            if meta is None:
                raise Refused(f"{name}: handle {args[i]} is an optimizer, not a tensor")
            metas[i] = MetaTensor(*meta)
        if name in ("grad", "set_grad_none", "set_grad", "requires_grad_", "set_data", "backward", "cross_backward"):
            return [table.meta[args[targs[0]]]] if name == "grad" else []
        try:
            return infer(name, metas, targs, kwargs)
        except ShapeError as error:
            raise Refused(str(error)) from None

    # ---- optimizers, groups, bookkeeping -----------------------------------------------------

    def _optim_create(self, job, outs, args, targs, kwargs) -> None:
        table = job.table
        by_worker = defaultdict(list)
        for i in targs:
            if table.meta[args[i]] is None:
                raise Refused(f"optim_create: handle {args[i]} is not a tensor")
            for worker in table.where[args[i]].workers:
                by_worker[worker].append(args[i])
        self._check_alive(by_worker)
        for worker, params in by_worker.items():
            job.emit(worker, [job.seq, "optim_create", list(outs), params, list(range(len(params))), dict(kwargs), None])
        table.where[outs[0]], table.meta[outs[0]] = Placement(tuple(by_worker) or (table.home,)), None

    def _ensure_group(self, job, workers) -> None:
        """Collectives over `workers` need a process group of just them; make it once."""
        workers = tuple(workers)
        if len(workers) > 1 and workers not in self.groups:
            self.groups.add(workers)
            job.on_all(workers, "make_group", [], [], [], {"g": list(workers)})

    def _add_crossings(self, table, handle, crossed) -> None:
        if not crossed:
            return
        before = table.crossings.get(handle, frozenset())
        if handle < MAX_HANDLE:  # only client handles keep a crossing alive
            for crossing in crossed - before:
                self.crossings[crossing].refs += 1
        table.crossings[handle] = before | crossed

    def _forget_entered(self, job, handles=None) -> None:
        """Free the cached f's (of `handles`, or all of them)."""
        table = job.table
        for key in [k for k in table.entered if handles is None or k[0] in handles]:
            job.temps.append(table.entered.pop(key))

    def _free(self, job, handles) -> None:
        table = job.table
        if table.entered:
            self._forget_entered(job, set(handles))
        by_worker = defaultdict(list)
        for handle in handles:
            table.refused.pop(handle, None)
            table.meta.pop(handle, None)
            table.direct.pop(handle, None)
            placement = table.where.pop(handle, None)
            for worker in placement.workers if placement else ():
                by_worker[worker].append(handle)
            self._unref(table.crossings.pop(handle, ()), job.streams)
        for worker, owned in by_worker.items():
            if self.is_alive(worker):
                job.emit(worker, [job.seq, "free", [], owned, [], {}, None])

    def _unref(self, crossings, streams) -> None:
        for crossing in crossings:
            link = self.crossings.get(crossing)
            if link is None:
                continue
            link.refs -= 1
            if link.refs <= 0:
                del self.crossings[crossing]
                for worker in set(link.src) | set(link.dst):
                    if self.is_alive(worker):
                        streams[worker].append([-1, "release", [], [crossing], [], {}, None])

    def drop_client(self, table: ClientTable) -> dict:
        """Release the crossings a departing client's graphs held; -> release streams."""
        streams = defaultdict(list)
        for crossings in table.crossings.values():
            self._unref(crossings, streams)
        table.crossings.clear()
        return streams

    def _check_alive(self, workers) -> None:
        for worker in workers:
            if not self.is_alive(worker):
                raise Refused(f"worker {worker} is lost (no heartbeat); tensors that lived there are gone")

    def _note(self, workers, signal, pattern: str) -> str:
        if len(workers) == 1 and signal is None:
            return ""
        text = f"[{signal.name}] " if signal is not None else ""
        return text + (pattern or "")

    def emit(self, streams, worker, instr, table, note: str = "") -> None:
        if self.log is not None:
            flags = instr[6] = dict(instr[6] or {})
            flags["L"] = self.log.describe(worker, instr, table, note)
        streams[worker].append(instr)


def _is_instruction(instr) -> bool:
    return isinstance(instr, list) and len(instr) == 7



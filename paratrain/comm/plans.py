"""Call plans: the messages of an all-reduce on a tensor, recorded by the second call on it and
replayed by every call after.

Most of an algorithm's Python (cutting the buffer into parts and segments, laying out the
steps, making one P2POp per message) produces the same messages every time it runs on the same
buffer: they depend only on the buffer, the world size and the algorithm. A training loop
all-reduces the same tensors every step (DDP's buckets, a flat gradient), so a Group keeps the
messages of a tensor's call and posts them again, with the new call's tag, when the same
tensor comes back. A tensor is only noted at its first call (a weak reference and its memory's
address): recording costs more than a call, and most tensors all-reduced once (a layer's fresh
activations) are never seen again. MPI-4 offers this as persistent collectives
(MPI_Allreduce_init, then MPI_Start per call); here it happens without the caller asking.
Measured with `call_path_us` (bench/overhead.py), a replay's path is 2 to 4 times shorter than
a first call's.

Only algorithms whose call is nothing but messages can be replayed (REPLAYABLE): the tree's
and direct's reductions copy and fold outside their messages. The shared-segment algorithms
(algorithms/shared.py) send no messages: their plan is the algorithm itself, called on the
tensor's flat view from the plan (`run`), so a call on a planned tensor skips the same checks.

A plan is recorded as a Schedule (transport/base.py): every post and every wait of the call,
in order. A transport that can compile one (TorchTransport on gloo) turns it into its own calls
once, and a replay then runs those with nothing in between (MPI's persistent requests); other
transports replay the schedule through Link. A call on a planned tensor goes straight to its
plan (CallPlans.ready, Group._run_straight), skipping the checks and the description of the call
that the recording call already made.

A plan holds its tensor's memory, so it is dropped when the tensor is (a weak reference on the
caller's tensor; the plan's messages alias the memory without referring to the tensor), and it
is checked against the tensor's memory before each use: a tensor whose storage was swapped
(`set_`, `resize_`) gets a new plan. The works of the last two calls, which a Group keeps a
little longer (see Group._retired), still refer to it: a plan goes at most two calls after its
tensor.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from paratrain.comm.algorithms.shared import SHARED_ALGORITHMS, planned_call
from paratrain.comm.checks import CallSignature
from paratrain.comm.link import Link
from paratrain.comm.transport.base import POST, P2POp, Schedule

REPLAYABLE = frozenset({"ring", "hd"})  # all-reduce algorithms that are only messages
CALLED = frozenset(SHARED_ALGORITHMS)  # those planned as a call of the algorithm
CAPACITY = 64  # tensors planned at once: DDP's buckets, with room; the oldest goes first


class _Plan:
    __slots__ = ("owner", "data_ptr", "numel", "dtype", "algo", "op", "signature", "nbytes", "schedule",
                 "messages", "compiled", "run", "timed", "facts", "asked")

    def __init__(self, owner, buf: torch.Tensor, algo: str, op: str, signature: CallSignature):
        self.owner = owner  # weakref to the caller's tensor
        self.data_ptr, self.numel, self.dtype = buf.data_ptr(), buf.numel(), buf.dtype
        self.algo, self.op = algo, op
        self.signature = signature  # the call that recorded the plan, as the flight recorder saw it
        self.nbytes = buf.numel() * buf.element_size()
        self.schedule: Schedule | None = None  # recorded by the second call
        self.messages: list[P2POp] = []  # every P2POp of the schedule, for retagging
        self.compiled = None  # the transport's own form of the schedule, where it has one
        self.run = None  # run(link): the call again (its messages replayed, or a CALLED algorithm run)
        self.timed = None  # timed(timeout): the call again where it sends no message (a shared-segment plan)
        self.facts = None  # (memory, shape, dtype, reduce op) of the planned call, all at once (ready)
        self.asked = None  # (the `algo` argument, table, its version) confirmed to resolve to `algo` (Group)

    def fits(self, tensor: torch.Tensor, buf: torch.Tensor, algo: str, op: str) -> bool:
        return (self.owner() is tensor and self.algo == algo and self.op == op
                and self.data_ptr == buf.data_ptr() and self.numel == buf.numel() and self.dtype == buf.dtype)


def _alias(view: torch.Tensor) -> torch.Tensor:
    """The memory of `view`, without its link to the tensor it views: a view keeps that
    tensor's Python object alive (`view._base`), which would keep the plan's weak reference
    to it from ever firing."""
    alias = torch.empty(0, dtype=view.dtype, device=view.device)
    return alias.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


class CallPlans:
    """One Group's plans, by the id of the tensor they were made for: tensors seen once
    (`noted`, no messages yet) apart from those with a recorded program (`planned`), so that a
    stream of fresh tensors never pushes out the plans of the tensors that come back."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity  # of each table
        self.noted: dict[int, _Plan] = {}
        self.planned: dict[int, _Plan] = {}
        self.made = 0  # programs recorded so far: a steady state of calls on the same tensors records none

    def ready(self, tensor, reduce_op: str) -> _Plan | None:
        """`tensor`'s plan if it was recorded by a call just like this one: the same tensor,
        memory, shape, dtype and reduce op. Such a call needs nothing but the plan replayed
        (Group._run_straight), since the recording call's checks hold for it too. `tensor` may be
        anything a caller passed: only a planned tensor matches."""
        plan = self.planned.get(id(tensor))
        if (plan is None or plan.owner() is not tensor
                or plan.facts != (tensor.data_ptr(), tensor.shape, tensor.dtype, reduce_op)
                or not tensor.is_contiguous()):
            return None
        return plan

    def all_reduce(self, link: Link, tensor: torch.Tensor, buf: torch.Tensor, algo: str, op: str,
                   algorithm: Callable[[Link, torch.Tensor, str], None], signature: CallSignature) -> None:
        """Run `algorithm` on `buf` (`tensor` itself, flattened), replaying `tensor`'s plan if
        it has one that fits; `signature` is the call's own."""
        if algo not in REPLAYABLE and algo not in CALLED or not tensor.is_contiguous():  # else buf is a copy
            algorithm(link, buf, op)
            return
        key = id(tensor)
        plan = self.planned.get(key)
        if plan is not None and plan.fits(tensor, buf, algo, op):
            plan.run(link)
            return
        plan = self.noted.pop(key, None)
        if plan is None or not plan.fits(tensor, buf, algo, op):  # first seen: only noted
            algorithm(link, buf, op)
            self._keep(self.noted, key, _Plan(self._owner(tensor, key), buf, algo, op, signature))
            return
        plan.signature = signature
        plan.facts = (plan.data_ptr, signature.shape, signature.dtype, signature.reduce_op)
        if algo in CALLED:
            algorithm(link, buf, op)
            flat = _alias(buf)
            plan.timed = planned_call("all_reduce", algo, link, flat, flat, op)
            timed = plan.timed
            plan.run = (lambda link: timed(link.timeout)) if timed else (lambda link: algorithm(link, flat, op))
            self._keep(self.planned, key, plan)
            self.made += 1
            return
        link.schedule = []  # seen again: worth a plan
        algorithm(link, buf, op)
        plan.schedule, link.schedule = link.schedule, None
        plan.messages = [op for what, ops in plan.schedule if what == POST for op in ops]
        for op in plan.messages:
            op.tensor = _alias(op.tensor)
        compile_schedule = getattr(link.transport, "compile", None)
        plan.compiled = compile_schedule(plan.schedule) if compile_schedule is not None else None
        plan.run = lambda link: link.replay(plan.schedule, plan.messages, plan.compiled)
        self._keep(self.planned, key, plan)
        self.made += 1

    def _owner(self, tensor: torch.Tensor, key: int) -> weakref.ref:
        tables = (self.noted, self.planned)

        def forget(ref) -> None:  # the tensor is gone: so are its plan and the memory it held
            for table in tables:
                if key in table and table[key].owner is ref:
                    del table[key]

        return weakref.ref(tensor, forget)

    def _keep(self, table: dict[int, _Plan], key: int, plan: _Plan) -> None:
        table.pop(key, None)
        if len(table) >= self.capacity:
            del table[next(iter(table))]  # dicts keep insertion order: the oldest
        table[key] = plan

    def clear(self) -> None:
        self.noted.clear()
        self.planned.clear()


class _Repeat:
    """A reduce-scatter or all-gather noted with its tensors: what Group._run_straight needs to
    make it again (its signature for the flight recorder, the algorithm it ran, `run(link)`)."""

    __slots__ = ("owners", "pointers", "shapes", "dtype", "algo", "nbytes", "signature", "run", "timed", "asked")

    def __init__(self, owners, output: torch.Tensor, input: torch.Tensor, algo: str, nbytes: int,
                 signature: CallSignature, run: Callable[[Link], None] | None,
                 timed: Callable[[float], None] | None):
        self.owners = owners  # weak references to (output, input)
        self.pointers = (output.data_ptr(), input.data_ptr())
        self.shapes, self.dtype = (output.shape, input.shape), output.dtype
        self.algo, self.nbytes, self.signature, self.run, self.timed = algo, nbytes, signature, run, timed
        self.asked = None  # as _Plan's


class RepeatedCalls:
    """A group's last reduce-scatters and all-gathers, by the op, their two tensors and the
    reduction: a call like one of them (the same tensors, memory, shapes and dtype, both
    contiguous) needs none of its checks again and runs straight (Group._run_straight), as an
    all-reduce's plan does. ZeRO and FSDP make the same calls on the same buffers every step.
    Entries hold views of the tensors' memory, not the tensors, and go when either tensor does.
    As with plans, a call is only seen the first time (its key kept) and noted the second: fresh
    tensors every call (a layer's activations) never pay for an entry."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self.calls: dict[tuple, _Repeat] = {}
        self.seen: dict[tuple, None] = {}  # keys of calls made once

    def ready(self, op_name: str, output, input, reduce_op: str) -> _Repeat | None:
        entry = self.calls.get((op_name, id(output), id(input), reduce_op))
        if (entry is None or entry.owners[0]() is not output or entry.owners[1]() is not input
                or entry.pointers != (output.data_ptr(), input.data_ptr())
                or entry.shapes != (output.shape, input.shape) or entry.dtype != output.dtype
                or not (output.is_contiguous() and input.is_contiguous())):
            return None
        return entry

    def note(self, link: Link, output: torch.Tensor, input: torch.Tensor, reduce_op: str, algo: str,
             nbytes: int, signature: CallSignature, make_run: Callable) -> None:
        """Keep the call just made through `link`: the algorithm's planned call (algorithms/shared.py,
        `timed`) where it has one, else `make_run(output, input)` (`run`), both on views of the two
        tensors' memory (_alias), so that the entry does not hold the tensors."""
        op_name = link.op_name
        if not (output.is_contiguous() and input.is_contiguous()):
            return
        key = (op_name, id(output), id(input), reduce_op)
        if key not in self.seen:  # a first sighting: only its key is kept
            if len(self.seen) >= self.capacity:
                del self.seen[next(iter(self.seen))]
            self.seen[key] = None
            return
        del self.seen[key]
        calls = self.calls

        def forget(ref) -> None:
            entry = calls.get(key)
            if entry is not None and ref in entry.owners:
                del calls[key]

        out, inp = _alias(output.view(-1)), _alias(input.view(-1))
        base = "sum" if reduce_op == "avg" else reduce_op  # an average is divided after (Group)
        timed = planned_call(op_name, algo, link, inp, out, base)
        run = None if timed else make_run(out, inp)
        owners = (weakref.ref(output, forget), weakref.ref(input, forget))
        calls.pop(key, None)
        if len(calls) >= self.capacity:
            del calls[next(iter(calls))]
        calls[key] = _Repeat(owners, output, input, algo, nbytes, signature, run, timed)

    def clear(self) -> None:
        self.calls.clear()
        self.seen.clear()

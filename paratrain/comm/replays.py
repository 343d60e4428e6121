"""Replays: a collective call made again on the same tensors runs what the earlier call worked
out, and nothing else. A Group holds one `Replays`.

All-reduces (`AllReduceReplays`): the messages of an all-reduce on a tensor, recorded by the
second call on it and replayed by every call after. Most of an algorithm's Python (cutting the
buffer into parts and segments, laying out the steps, making one P2POp per message) produces the
same messages every time it runs on the same buffer: they depend only on the buffer, the world
size and the algorithm. A training loop all-reduces the same tensors every step (DDP's buckets,
a flat gradient), so the Group keeps the messages of a tensor's call and posts them again, with
the new call's tag, when the same tensor comes back. A tensor is only noted at its first call (a
weak reference and its memory's address): recording costs more than a call, and most tensors
all-reduced once (a layer's fresh activations) are never seen again. MPI-4 offers this as
persistent collectives (MPI_Allreduce_init, then MPI_Start per call); here it happens without
the caller asking. Measured with `call_path_us` (bench/overhead.py), a replay's path is 2 to 4
times shorter than a first call's.

Only algorithms whose call is nothing but messages can be recorded (RECORDABLE): the tree's and
direct's reductions copy and fold outside their messages. The shared-segment algorithms
(algorithms/shared.py) send no messages: their replay is the algorithm itself, called on the
tensor's flat view (`run`), or its one-shot form worked out once (algorithms/shared_replays.py,
`timed`), so a call on a replayed tensor skips the same checks.

The messages are recorded as a Schedule (transport/base.py): every post and every wait of the
call, in order. A transport that can compile one (TorchTransport on gloo) turns it into its own
calls once, and a replay then runs those with nothing in between (MPI's persistent requests);
other transports replay the schedule through Link. A call on a replayed tensor goes straight to
its replay (AllReduceReplays.ready, CollectiveCalls.run_straight), skipping the checks and the
description of the call that the recording call already made.

A replay holds its tensor's memory, so it is dropped when the tensor is (a weak reference on the
caller's tensor; the recorded messages alias the memory without referring to the tensor), and it
is checked against the tensor's memory before each use: a tensor whose storage was swapped
(`set_`, `resize_`) is recorded anew. The works of the last two calls, which a Group keeps a
little longer (see Group._retired), still refer to it: a replay goes at most two calls after its
tensor.

Reduce-scatters and all-gathers (`RepeatedCalls`): a call made again on the same two tensors,
noted at its second call, runs straight from the third.
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

import torch

from paratrain.comm.algorithms.shared import SHARED_ALGORITHMS
from paratrain.comm.algorithms.shared_replays import replay_of
from paratrain.comm.checks import CallSignature
from paratrain.comm.link import Link
from paratrain.comm.transport.base import POST, P2POp, Schedule

RECORDABLE = frozenset({"ring", "hd"})  # all-reduce algorithms that are only messages
CALLED = frozenset(SHARED_ALGORITHMS)  # those replayed as a call of the algorithm
CAPACITY = 64  # tensors replayed at once: DDP's buckets, with room; the oldest goes first


class _Replay:
    """One tensor's all-reduce: noted at its first call, recorded (`run`) at its second."""

    __slots__ = ("owner", "data_ptr", "numel", "dtype", "algo", "op", "signature", "nbytes", "schedule",
                 "messages", "compiled", "run", "timed", "facts", "asked")

    def __init__(self, owner, buf: torch.Tensor, algo: str, op: str, signature: CallSignature):
        self.owner = owner  # weakref to the caller's tensor
        self.data_ptr, self.numel, self.dtype = buf.data_ptr(), buf.numel(), buf.dtype
        self.algo, self.op = algo, op
        self.signature = signature  # the call that recorded it, as the flight recorder saw it
        self.nbytes = buf.numel() * buf.element_size()
        self.schedule: Schedule | None = None  # recorded by the second call
        self.messages: list[P2POp] = []  # every P2POp of the schedule, for retagging
        self.compiled = None  # the transport's own form of the schedule, where it has one
        self.run = None  # run(link): the call again (its messages replayed, or a CALLED algorithm run)
        self.timed = None  # timed(timeout): the call again where it sends no message (shared_replays.py)
        self.facts = None  # (memory, shape, dtype, reduce op) of the recorded call, all at once (ready)
        self.asked = None  # (the `algo` argument, table, its version) confirmed to resolve to `algo` (Group)

    def fits(self, tensor: torch.Tensor, buf: torch.Tensor, algo: str, op: str) -> bool:
        return (self.owner() is tensor and self.algo == algo and self.op == op
                and self.data_ptr == buf.data_ptr() and self.numel == buf.numel() and self.dtype == buf.dtype)

    def kind(self) -> str:
        """How it runs (see Replays.kind_of)."""
        if self.timed is not None:
            return _timed_kind(self.timed)
        if self.schedule is None:
            return "call"
        return "compiled" if self.compiled is not None else "schedule"


def _timed_kind(timed) -> str:
    """A one-shot replay's kind: C kernels' runs carry their plans (shared_kernels.running)."""
    return "kernel" if hasattr(timed, "plans") else "worked out"


def _alias(view: torch.Tensor) -> torch.Tensor:
    """The memory of `view`, without its link to the tensor it views: a view keeps that
    tensor's Python object alive (`view._base`), which would keep the replay's weak reference
    to it from ever firing."""
    alias = torch.empty(0, dtype=view.dtype, device=view.device)
    return alias.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


class AllReduceReplays:
    """One Group's all-reduce replays, by the id of the tensor they were made for: tensors seen
    once (`noted`, no messages yet) apart from those recorded (`recorded`), so that a stream of
    fresh tensors never pushes out the replays of the tensors that come back."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity  # of each table
        self.noted: dict[int, _Replay] = {}
        self.recorded: dict[int, _Replay] = {}
        self.made = 0  # recordings so far: a steady state of calls on the same tensors makes none

    def ready(self, tensor, reduce_op: str) -> _Replay | None:
        """`tensor`'s replay if it was recorded by a call just like this one: the same tensor,
        memory, shape, dtype and reduce op. Such a call needs nothing but the replay
        (CollectiveCalls.run_straight), since the recording call's checks hold for it too.
        `tensor` may be anything a caller passed: only a recorded tensor matches."""
        replay = self.recorded.get(id(tensor))
        if (replay is None or replay.owner() is not tensor
                or replay.facts != (tensor.data_ptr(), tensor.shape, tensor.dtype, reduce_op)
                or not tensor.is_contiguous()):
            return None
        return replay

    def run(self, tensor: torch.Tensor, signature: CallSignature, link: Link, algo: str,
            algorithm: Callable[[Link, torch.Tensor, str], None], args: tuple[torch.Tensor, str]) -> None:
        """Run `algorithm` on args = (buf, op), buf being `tensor` itself, flattened: through
        `tensor`'s replay if it has one that fits, recording it at the second such call;
        `signature` is the call's own."""
        buf, op = args
        if algo not in RECORDABLE and algo not in CALLED or not tensor.is_contiguous():  # else buf is a copy
            algorithm(link, buf, op)
            return
        key = id(tensor)
        replay = self.recorded.get(key)
        if replay is not None and replay.fits(tensor, buf, algo, op):
            replay.run(link)
            return
        replay = self.noted.pop(key, None)
        if replay is None or not replay.fits(tensor, buf, algo, op):  # first seen: only noted
            algorithm(link, buf, op)
            self._keep(self.noted, key, _Replay(self._owner(tensor, key), buf, algo, op, signature))
            return
        replay.signature = signature
        replay.facts = (replay.data_ptr, signature.shape, signature.dtype, signature.reduce_op)
        if algo in CALLED:
            algorithm(link, buf, op)
            self._call(replay, link, algorithm, buf)
        else:
            self._record(replay, link, algorithm, buf)
        self._keep(self.recorded, key, replay)
        self.made += 1

    @staticmethod
    def _call(replay: _Replay, link: Link, algorithm, buf: torch.Tensor) -> None:
        """A shared-segment algorithm's replay: its one-shot form worked out once where it has
        one, else the algorithm called on the buffer's memory."""
        flat, op = _alias(buf), replay.op
        replay.timed = timed = replay_of("all_reduce", replay.algo, link, flat, flat, op)
        replay.run = (lambda link: timed(link.timeout)) if timed else (lambda link: algorithm(link, flat, op))

    @staticmethod
    def _record(replay: _Replay, link: Link, algorithm, buf: torch.Tensor) -> None:
        """Run the algorithm with its messages recorded, and keep them (compiled where the
        transport can) to be posted again."""
        link.schedule = []
        algorithm(link, buf, replay.op)
        replay.schedule, link.schedule = link.schedule, None
        replay.messages = [message for what, ops in replay.schedule if what == POST for message in ops]
        for message in replay.messages:
            message.tensor = _alias(message.tensor)
        compile_schedule = getattr(link.transport, "compile", None)
        replay.compiled = compile_schedule(replay.schedule) if compile_schedule is not None else None
        replay.run = lambda link: link.replay(replay.schedule, replay.messages, replay.compiled)

    def _owner(self, tensor: torch.Tensor, key: int) -> weakref.ref:
        tables = (self.noted, self.recorded)

        def forget(ref) -> None:  # the tensor is gone: so are its replay and the memory it held
            for table in tables:
                if key in table and table[key].owner is ref:
                    del table[key]

        return weakref.ref(tensor, forget)

    def _keep(self, table: dict[int, _Replay], key: int, replay: _Replay) -> None:
        table.pop(key, None)
        if len(table) >= self.capacity:
            del table[next(iter(table))]  # dicts keep insertion order: the oldest
        table[key] = replay

    def clear(self) -> None:
        self.noted.clear()
        self.recorded.clear()


class _Repeat:
    """A reduce-scatter or all-gather noted with its tensors: what CollectiveCalls.run_straight
    needs to make it again (its signature for the flight recorder, the algorithm it ran,
    `run(link)`)."""

    __slots__ = ("owners", "pointers", "shapes", "dtype", "algo", "nbytes", "signature", "run", "timed", "asked")

    def __init__(self, owners, output: torch.Tensor, input: torch.Tensor, algo: str, nbytes: int,
                 signature: CallSignature, run: Callable[[Link], None] | None,
                 timed: Callable[[float], None] | None):
        self.owners = owners  # weak references to (output, input)
        self.pointers = (output.data_ptr(), input.data_ptr())
        self.shapes, self.dtype = (output.shape, input.shape), output.dtype
        self.algo, self.nbytes, self.signature, self.run, self.timed = algo, nbytes, signature, run, timed
        self.asked = None  # as _Replay's

    def kind(self) -> str:
        return "call" if self.timed is None else _timed_kind(self.timed)


class RepeatedCalls:
    """A group's last reduce-scatters and all-gathers, by the op, their two tensors and the
    reduction: a call like one of them (the same tensors, memory, shapes and dtype, both
    contiguous) needs none of its checks again and runs straight (CollectiveCalls.run_straight),
    as an all-reduce's replay does. ZeRO and FSDP make the same calls on the same buffers every step.
    Entries hold views of the tensors' memory, not the tensors, and go when either tensor does.
    As with all-reduces, a call is only seen the first time (its key kept) and noted the second:
    fresh tensors every call (a layer's activations) never pay for an entry."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self.calls: dict[tuple, _Repeat] = {}
        # calls made once: their key, and weak references to their two tensors (Python reuses a
        # freed tensor's id at once, so a key alone would take a fresh tensor every call, as a
        # layer's activations are, for the one before it, and work out an entry that never runs)
        self.seen: dict[tuple, tuple] = {}
        self.made = 0  # entries worked out so far: fresh tensors every call make none

    def ready(self, op_name: str, output, input, reduce_op: str) -> _Repeat | None:
        entry = self.calls.get((op_name, id(output), id(input), reduce_op))
        if (entry is None or entry.owners[0]() is not output or entry.owners[1]() is not input
                or entry.pointers != (output.data_ptr(), input.data_ptr())
                or entry.shapes != (output.shape, input.shape) or entry.dtype != output.dtype
                or not (output.is_contiguous() and input.is_contiguous())):
            return None
        return entry

    def run(self, output: torch.Tensor, input: torch.Tensor, reduce_op: str, nbytes: int,
            signature: CallSignature, link: Link, algo: str, algorithm: Callable, args: tuple) -> None:
        """Run `algorithm` on args = (flat input, flat output[, reduce op as run]), then keep the
        call: the algorithm's one-shot form (algorithms/shared_replays.py, `timed`) where it has
        one, else the algorithm on the same arguments (`run`), both on views of the two tensors'
        memory (_alias), so that the entry does not hold the tensors."""
        algorithm(link, *args)
        op_name = link.op_name
        if not (output.is_contiguous() and input.is_contiguous()):
            return
        key = (op_name, id(output), id(input), reduce_op)
        before = self.seen.pop(key, None)
        if before is None or before[0]() is not output or before[1]() is not input:  # a first sighting
            if len(self.seen) >= self.capacity:
                del self.seen[next(iter(self.seen))]
            self.seen[key] = (weakref.ref(output), weakref.ref(input))
            return
        calls = self.calls

        def forget(ref) -> None:
            entry = calls.get(key)
            if entry is not None and ref in entry.owners:
                del calls[key]

        out, inp, rest = _alias(output.view(-1)), _alias(input.view(-1)), args[2:]
        timed = replay_of(op_name, algo, link, inp, out, *rest)
        run = None if timed else (lambda link: algorithm(link, inp, out, *rest))
        owners = (weakref.ref(output, forget), weakref.ref(input, forget))
        calls.pop(key, None)
        if len(calls) >= self.capacity:
            del calls[next(iter(calls))]
        calls[key] = _Repeat(owners, output, input, algo, nbytes, signature, run, timed)
        self.made += 1

    def clear(self) -> None:
        self.calls.clear()
        self.seen.clear()


class Held(NamedTuple):
    """What a Group's replays hold now."""

    all_reduces: int  # tensors whose all-reduce is recorded
    noted: int  # tensors all-reduced once, noted for their second call
    repeats: int  # reduce-scatters and all-gathers that run straight


class Replays:
    """A Group's replay cache: its all-reduces (`all_reduces`) and its repeated reduce-scatters
    and all-gathers (`repeats`). `recorded`, `held` and `kind_of` say from outside what it did
    (how a benchmark or a test sees that a loop on the same tensors runs from its replays);
    Group.straight_calls says how many calls ran straight from one."""

    def __init__(self, capacity: int = CAPACITY):
        self.all_reduces = AllReduceReplays(capacity)
        self.repeats = RepeatedCalls(capacity)

    @property
    def recorded(self) -> int:
        """All-reduce replays recorded so far: a steady loop on the same tensors records none."""
        return self.all_reduces.made

    def held(self) -> Held:
        return Held(len(self.all_reduces.recorded), len(self.all_reduces.noted), len(self.repeats.calls))

    def kind_of(self, tensor: torch.Tensor) -> str | None:
        """How an all-reduce of `tensor` replays, None where it does not: "compiled" (the
        transport's own calls, made once), "schedule" (the recorded messages, posted again
        through Link), "kernel" (a one-shot call in C), "worked out" (a one-shot call in
        Python, its addresses worked out once) or "call" (the algorithm, called again)."""
        replay = self.all_reduces.recorded.get(id(tensor))
        return replay.kind() if replay is not None and replay.owner() is tensor else None

    def kinds(self) -> list[str]:
        """How each replay held runs (as kind_of says), all-reduces first."""
        return ([replay.kind() for replay in self.all_reduces.recorded.values()]
                + [entry.kind() for entry in self.repeats.calls.values()])

    def clear(self) -> None:
        self.all_reduces.clear()
        self.repeats.clear()

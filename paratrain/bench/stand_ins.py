"""The stand-in transports `bench collectives --overhead` (overhead.py) records a call through
and times paratrain's own code against: RecordingTransport notes every batch of sends and
receives a call starts, every wait and every native collective, passing each on; NullTransport
moves nothing (every send and receive is done at once), so a call through it is paratrain's
call path alone."""

from __future__ import annotations

from paratrain.comm.transport.base import P2POp
from paratrain.comm.transport.shm_arena import Arena


class RecordingTransport:
    """A transport that passes everything to `inner` and keeps a list of what it was asked."""

    compile = None  # a compiled replay would skip start() and the waits: every call is recorded

    def __init__(self, inner):
        self.inner = inner
        self.events: list[tuple] = []  # ("start", ops) | ("wait", op index) | ("native", name, args)
        self.ops = 0  # p2p ops started so far

    def __getattr__(self, name):  # rank, size, kind, flight, segment_bytes, ... and the natives
        attribute = getattr(self.inner, name)
        if not name.startswith("native_"):
            return attribute

        def native(*args):
            self.events.append(("native", name, args))
            return attribute(*args)

        return native

    def start(self, ops: list[P2POp]) -> list:
        works = self.inner.start(ops)
        self.events.append(("start", [(op.kind, op.tensor, op.peer, op.reduce) for op in ops]))
        first, self.ops = self.ops, self.ops + len(ops)
        return [_RecordedWork(self.events, first + i, work) for i, work in enumerate(works)]


class _RecordedWork:
    def __init__(self, events: list, index: int, work):
        self.events, self.index, self.work = events, index, work
        self.kind, self.peer = work.kind, work.peer

    def wait(self, timeout: float) -> None:
        self.events.append(("wait", self.index))
        self.work.wait(timeout)


class NullTransport:
    """A transport that moves nothing: every op is done as soon as it starts, every native
    collective returns at once. Otherwise it is `inner` (rank, size, kind, flight, ...). It
    compiles nothing (inner's compiled replay would move real messages), so a replayed call runs
    Link.replay's loop over start() and the waits: more Python than gloo's compiled replay."""

    compile = None

    def __init__(self, inner):
        self.inner = inner
        # Copied, not forwarded: a lookup through __getattr__ on every call would be timed too.
        for name in ("rank", "size", "kind", "global_ranks", "flight", "segment_bytes", "posts_ahead"):
            setattr(self, name, getattr(inner, name))
        # The shared-segment algorithms copy and reduce in a segment of this process's own whose
        # steps wait for nobody: their path is their copies and reductions, not the peers' pace.
        self.arena = Arena.alone(inner.size, inner.rank) if getattr(inner, "arena", None) is not None else None
        if self.arena is not None:  # the kernels the group's own segment runs, if it has them
            self.arena.native = inner.arena.native

    def __getattr__(self, name):
        if name.startswith("native_"):
            return _do_nothing
        return getattr(self.inner, name)

    def start(self, ops: list[P2POp]) -> list:
        return [_DoneWork(op.kind, op.peer) for op in ops]


def _do_nothing(*args) -> None:
    return None


class _DoneWork:
    __slots__ = ("kind", "peer")

    def __init__(self, kind: str, peer: int):
        self.kind, self.peer = kind, peer

    def wait(self, timeout: float) -> None:
        return None

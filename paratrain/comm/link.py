"""What a collective algorithm sees: its rank, the world size, and point-to-point bound to one
call, so that a wait that times out or loses its peer can say which call and which peer it was."""

from __future__ import annotations

import torch

from typing import NamedTuple

from paratrain.comm.errors import (
    CommTimeoutError, FabricAborted, PeerLostError, TransportFailure, TransportTimeout,
)
from paratrain.comm.scratch import ScratchPool
from paratrain.comm.transport.base import POST, WAIT, P2POp, Schedule


# Four pieces already hide all but a quarter of a step's reduction behind its transfer; more
# only add messages, each with its own cost in the call's code and the transport.
MAX_SEGMENTS = 4

# What transports raise when a wait gives up or a peer is gone.
TRANSPORT_ERRORS = (TransportTimeout, TransportFailure, FabricAborted)


def comm_error(error: Exception, rank: int, op_name: str, seq: int, timeout: float, transport=None) -> Exception:
    """The error a caller sees for a transport's `error`: who, in which call, for whom (and, in a
    group spread over hosts, on which host: `transport`'s host_names). Raise it
    `from original_cause(error)`."""
    if isinstance(error, TransportTimeout):
        return CommTimeoutError(rank, op_name, seq, error.peer, timeout)
    names, world = getattr(transport, "host_names", None), getattr(transport, "global_ranks", None)
    where = None
    if names and error.peer is not None and len(set(names)) > 1:  # a group spread over hosts: which one
        where = f"world rank {world[error.peer]} on host {names[error.peer]}"
    return PeerLostError(rank, op_name, seq, error.peer, str(error), where)


def original_cause(error: Exception) -> BaseException:
    """The backend's own exception behind a transport's error (or the error itself)."""
    return error.__cause__ or error


class Step(NamedTuple):
    """One step of an exchange: send `send` to `dst` while receiving `recv` from `src`
    (combined into it with `reduce`, if set). Either side may be None."""

    send: torch.Tensor | None = None
    dst: int | None = None
    recv: torch.Tensor | None = None
    src: int | None = None
    reduce: str | None = None


class Link:
    """Point-to-point for one collective call. Every message of every call goes through here,
    so it is kept lean: one P2POp per message, no copies, no sorting, no lists made twice."""

    __slots__ = ("transport", "scratch", "rank", "size", "op_name", "seq", "tag", "timeout", "segment_bytes",
                 "finished", "schedule", "_numbers")

    def __init__(self, transport, op_name: str, seq: int, tag: int, timeout: float, segment_bytes: int,
                 scratch: ScratchPool | None = None):
        self.transport = transport
        self.scratch = scratch if scratch is not None else ScratchPool()
        self.rank, self.size = transport.rank, transport.size
        self.op_name, self.seq, self.tag = op_name, seq, tag
        self.timeout = timeout
        self.segment_bytes = segment_bytes
        self.finished: list = []  # every work this call waited for: the Group frees them later
        self.schedule: Schedule | None = None  # when a list, every post and wait is recorded in it
        self._numbers: dict[int, int] = {}  # while recording: id of a work -> its message's number

    def start(self, ops: list[P2POp]) -> list:
        if self.schedule is not None:  # only whole runs of steps can be recorded and replayed
            raise RuntimeError(f"{self.op_name}: an algorithm that posts its own messages cannot be replayed")
        for op in ops:
            op.tag = self.tag
        return self._post(ops)

    def wait(self, works: list) -> None:
        # Receives first: on the fabric a send completes only once its receiver has copied it,
        # so two ranks that both waited on their sends first would wait for each other forever.
        self._complete([work for work in works if work.kind == "recv"] +
                       [work for work in works if work.kind != "recv"])

    def _complete(self, works: list) -> None:
        """Wait for `works` in their order (the caller has put receives first)."""
        if self.schedule is not None:
            self.schedule.append((WAIT, [self._numbers[id(work)] for work in works]))
        try:
            for work in works:
                work.wait(self.timeout)
        except TRANSPORT_ERRORS as error:
            raise comm_error(error, self.rank, self.op_name, self.seq, self.timeout, self.transport) from original_cause(error)
        self.finished += works

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        if tensor.numel() == 0:  # both sides know the size, so both skip
            return
        self._play([[]], [[P2POp("send", tensor, peer, self.tag)]])

    def recv(self, tensor: torch.Tensor, peer: int, reduce: str | None = None) -> None:
        if tensor.numel() == 0:
            return
        self._play([[P2POp("recv", tensor, peer, self.tag, reduce)]], [[]])

    def start_sends(self, pieces: list[torch.Tensor], peer: int) -> list:
        return self.start([P2POp("send", piece, peer) for piece in pieces])

    def start_recvs(self, pieces: list[torch.Tensor], peer: int, reduce: str | None = None) -> list:
        return self.start([P2POp("recv", piece, peer, reduce=reduce) for piece in pieces])

    def segments(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a message so that reducing one piece overlaps the transfer of the next: pieces
        of about `segment_bytes`, but never more than MAX_SEGMENTS of them, as each message costs
        the same few microseconds of Python whatever its size (a message that fits one segment,
        the common case, is returned as it is)."""
        nbytes = flat.numel() * flat.element_size()
        if nbytes <= self.segment_bytes:
            return (flat,)
        return flat.tensor_split(min(MAX_SEGMENTS, -(-nbytes // self.segment_bytes)))

    def exchange(
        self,
        send: torch.Tensor | None = None,
        dst: int | None = None,
        recv: torch.Tensor | None = None,
        src: int | None = None,
        reduce: str | None = None,
    ) -> None:
        """Send `send` to `dst` while receiving `recv` from `src` (combining with `reduce` if set),
        segment by segment, all posted at once and completed in order."""
        self.run_steps([Step(send, dst, recv, src, reduce)])

    def run_steps(self, steps: list[Step]) -> None:
        """Run exchange steps in order; a step's sends may depend on its predecessor's receives.

        Each step's receives are posted before the step before it sends (where the transport
        allows it), so a peer that reaches a step finds its receive already posted: gloo sends
        a message only once the receiver has asked for it, and a send that has to wait for that
        costs a hand-off between threads on both ranks, each of which can wait a scheduler tick
        on a busy machine. Sends are waited for at the end: a step never writes what an earlier
        one is still sending (an all-gather overwrites a part only with values that could not
        exist before the peer had received that part from us).
        """
        # Every message is made before the first is posted: between a receive completing and
        # the next send going out there is only the wait's own work. A ring passes each part
        # through several steps: each tensor is cut into segments once.
        cut: dict[int, tuple[torch.Tensor, ...]] = {}
        receives = [self._messages("recv", step.recv, step.src, step.reduce, cut) for step in steps]
        sends = [self._messages("send", step.send, step.dst, None, cut) for step in steps]
        self._play(receives, sends)

    def replay(self, schedule: Schedule, messages: list[P2POp], compiled=None) -> None:
        """Post and complete a recorded call's messages again, as this call's (`messages`: every
        P2POp of `schedule`, listed once when it was recorded). `compiled`, the transport's own
        form of the schedule (TorchTransport.compile), runs it with no Link code in between."""
        if compiled is not None:
            try:
                self.finished += compiled(self.tag, self.timeout)
            except TRANSPORT_ERRORS as error:
                raise comm_error(error, self.rank, self.op_name, self.seq, self.timeout, self.transport) from original_cause(error)
            return
        tag = self.tag
        for op in messages:
            op.tag = tag
        works = []
        for what, arg in schedule:
            if what == POST:
                works += self._post(arg)
            else:
                self._complete([works[number] for number in arg])

    def _play(self, receives: list[list[P2POp]], sends: list[list[P2POp]]) -> None:
        """Run steps given as their messages (see run_steps)."""
        if not self.transport.posts_ahead:  # NCCL: each step's sends and receives in one batch
            for step_receives, step_sends in zip(receives, sends):
                self.wait(self._post(step_receives + step_sends))
            return
        sent = []
        pending = self._post(receives[0]) if receives else []
        last = len(receives) - 1
        for index in range(last + 1):
            following = self._post(receives[index + 1]) if index < last else []
            sent += self._post(sends[index])
            self._complete(pending)  # only receives
            pending = following
        self._complete(sent)  # only sends, after every receive

    def _post(self, ops: list[P2POp]) -> list:
        """transport.start for ops already tagged with this call's tag."""
        if not ops:
            return []
        try:
            works = self.transport.start(ops)
        except TRANSPORT_ERRORS as error:
            raise comm_error(error, self.rank, self.op_name, self.seq, self.timeout, self.transport) from original_cause(error)
        if self.schedule is not None:
            self.schedule.append((POST, ops))
            for work in works:
                self._numbers[id(work)] = len(self._numbers)
        return works

    def _messages(self, kind: str, tensor: torch.Tensor | None, peer: int | None, reduce: str | None,
                  cut: dict[int, tuple[torch.Tensor, ...]]) -> list[P2POp]:
        """One P2POp per segment of `tensor` (none for a missing or empty one)."""
        if tensor is None or tensor.numel() == 0:
            return []
        pieces = cut.get(id(tensor))
        if pieces is None:
            pieces = cut[id(tensor)] = self.segments(tensor)
        return [P2POp(kind, piece, peer, self.tag, reduce) for piece in pieces]

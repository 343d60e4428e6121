"""What a collective algorithm sees: its rank, the world size, and point-to-point bound to one
call, so that a wait that times out or loses its peer can say which call and which peer it was."""

from __future__ import annotations

import torch

from paratrain.comm.errors import (
    CommTimeoutError, FabricAborted, PeerLostError, TransportFailure, TransportTimeout,
)
from paratrain.comm.scratch import ScratchPool
from paratrain.comm.transport.base import P2POp


# What transports raise when a wait gives up or a peer is gone.
TRANSPORT_ERRORS = (TransportTimeout, TransportFailure, FabricAborted)


def comm_error(error: Exception, rank: int, op_name: str, seq: int, timeout: float) -> Exception:
    """The error a caller sees for a transport's `error`: who, in which call, for whom. Raise it
    `from original_cause(error)`."""
    if isinstance(error, TransportTimeout):
        return CommTimeoutError(rank, op_name, seq, error.peer, timeout)
    return PeerLostError(rank, op_name, seq, error.peer, str(error))


def original_cause(error: Exception) -> BaseException:
    """The backend's own exception behind a transport's error (or the error itself)."""
    return error.__cause__ or error


class Link:
    def __init__(self, transport, op_name: str, seq: int, tag: int, timeout: float, segment_bytes: int,
                 scratch: ScratchPool | None = None):
        self.transport = transport
        self.scratch = scratch if scratch is not None else ScratchPool()
        self.rank, self.size = transport.rank, transport.size
        self.op_name, self.seq, self.tag = op_name, seq, tag
        self.timeout = timeout
        self.segment_bytes = segment_bytes

    def start(self, ops: list[P2POp]) -> list:
        for op in ops:
            op.tag = self.tag
        try:
            return self.transport.start(ops)
        except TRANSPORT_ERRORS as error:
            raise comm_error(error, self.rank, self.op_name, self.seq, self.timeout) from original_cause(error)

    def wait(self, works: list) -> None:
        # Receives first: on the fabric a send completes only once its receiver has copied it,
        # so two ranks that both waited on their sends first would wait for each other forever.
        for work in sorted(works, key=lambda w: w.kind != "recv"):
            try:
                work.wait(self.timeout)
            except TRANSPORT_ERRORS as error:
                raise comm_error(error, self.rank, self.op_name, self.seq, self.timeout) from original_cause(error)

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        if tensor.numel() == 0:  # both sides know the size, so both skip
            return
        self.wait(self.start([P2POp("send", tensor, peer)]))

    def recv(self, tensor: torch.Tensor, peer: int, reduce: str | None = None) -> None:
        if tensor.numel() == 0:
            return
        self.wait(self.start([P2POp("recv", tensor, peer, reduce=reduce)]))

    def start_sends(self, pieces: list[torch.Tensor], peer: int) -> list:
        return self.start([P2POp("send", piece, peer) for piece in pieces])

    def start_recvs(self, pieces: list[torch.Tensor], peer: int, reduce: str | None = None) -> list:
        return self.start([P2POp("recv", piece, peer, reduce=reduce) for piece in pieces])

    def segments(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Split a message so that reducing one piece overlaps the transfer of the next."""
        step = max(1, self.segment_bytes // max(1, flat.element_size()))
        return list(flat.split(step)) if flat.numel() > step else [flat]

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
        ops = []
        if recv is not None and recv.numel() > 0:
            ops += [P2POp("recv", piece, src, reduce=reduce) for piece in self.segments(recv)]
        if send is not None and send.numel() > 0:
            ops += [P2POp("send", piece, dst) for piece in self.segments(send)]
        self.wait(self.start(ops))

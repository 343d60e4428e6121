"""A Group's point-to-point: isend, irecv, send, recv, sendrecv, checked, numbered and recorded
like its collectives. The Group (group.py) holds one PointToPoint and gives it what both kinds of
call share: the transport, the flight recorder, and what a failed and a finished call do."""

from __future__ import annotations

from collections.abc import Callable

import torch

from paratrain.comm import checks
from paratrain.comm.handles import DONE, Done, P2PHandle
from paratrain.comm.link import Link
from paratrain.comm.transport.base import P2POp

USER_TAGS = 1 << 20  # user p2p tags live below this; each collective call gets one above it
STRAIGHT_POLL_S = 1e-3  # a straight receive polls its ring this long (at most the transport's spin)


class PointToPoint:
    def __init__(self, transport, recorder, key, timeout: float, segment_bytes: int, scratch,
                 failed: Callable, retire: Callable):
        self.transport, self.size = transport, transport.size
        self._recorder, self._key = recorder, key  # the rank's flight recorder, the group's key in it
        self.timeout, self.segment_bytes, self._scratch = timeout, segment_bytes, scratch
        self._failed, self._retire = failed, retire  # Group._failed, Group._retire
        self._seq = 0
        # Shared-memory rings a blocking send or receive may use directly, and how long a
        # receive there polls for its message before it takes the general path.
        self._rings = getattr(transport, "p2p", None)
        self._straight_poll_s = min(STRAIGHT_POLL_S, self._rings.spin_s) if self._rings is not None else 0.0

    def _start_p2p(self, op: P2POp, target: torch.Tensor | None = None) -> P2PHandle:
        """Start `op`; `target` is where a receive into a staging buffer ends up."""
        if not isinstance(op.tag, int) or not 0 <= op.tag < USER_TAGS:
            raise ValueError(f"{op.kind}: tag must be an int in [0, {USER_TAGS}), got {op.tag!r}")
        self._seq += 1
        call = self._recorder.start(
            self._key, "p2p", self._seq, op.kind, (op.tensor.shape, op.tensor.dtype), None, op.peer,
        )
        link = Link(self.transport, op.kind, self._seq, op.tag, self.timeout, self.segment_bytes, self._scratch)
        try:
            (work,) = link.start([op])
        except Exception as error:
            self._failed(call, error)
            raise
        return P2PHandle(call, link, work, op.tensor if target is None else target, op.tensor,
                         self._failed, self._retire)

    def _check_peer(self, op_name: str, peer: int) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.size:
            raise ValueError(f"{op_name}: peer rank {peer!r} out of range [0, {self.size})")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> P2PHandle | Done:
        if self._went_straight("send", tensor, dst, tag):  # already in the ring: nothing to wait for
            return DONE
        checks.tensor_arg("isend", "tensor", tensor)
        self._check_peer("isend", dst)
        return self._start_p2p(P2POp("send", tensor.contiguous(), dst, tag))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> P2PHandle:
        checks.tensor_arg("irecv", "tensor", tensor)
        self._check_peer("irecv", src)
        staging = tensor if tensor.is_contiguous() else torch.empty_like(tensor).contiguous()
        return self._start_p2p(P2POp("recv", staging, src, tag), target=tensor)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        if not self._went_straight("recv", tensor, src, tag):
            self.irecv(tensor, src, tag).wait()
        return tensor

    def _went_straight(self, kind: str, tensor, peer, tag) -> bool:
        """A send, or a blocking receive, moved at once between `tensor` and a shared-memory ring (see
        SharedMemoryP2P.send_now): a small message costs a few microseconds, not the tens of
        the general path (a work, a Link, a handle). Recorded, already completed; False, having
        done nothing, wherever that short cut does not apply."""
        rings = self._rings
        if rings is None or type(tensor) is not torch.Tensor or not tensor.is_cpu \
                or not tensor.is_contiguous() or type(peer) is not int or type(tag) is not int \
                or not 0 <= tag < USER_TAGS:
            return False
        moved = (rings.send_now(peer, tag, tensor) if kind == "send"
                 else rings.recv_now(peer, tag, tensor, self._straight_poll_s))
        if moved:
            self._seq += 1
            self._recorder.done(self._key, "p2p", self._seq, kind, (tensor.shape, tensor.dtype), None, peer)
        return moved

    def sendrecv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int = 0):
        """Send to `dst` and receive from `src` at once (the step of every ring)."""
        if self._went_straight("send", send, dst, tag):  # all of it is in the ring: nothing to wait for
            return self.recv(recv, src, tag)
        receiving = self.irecv(recv, src, tag)
        sending = self.isend(send, dst, tag)
        receiving.wait()
        sending.wait()
        return recv

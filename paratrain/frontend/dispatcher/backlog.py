"""What waits to be sent to each peer, and the bound on it.

ZeroMQ queues up to SEND_QUEUE messages for each peer itself (the socket's SNDHWM); a peer's
ZeroMQ takes them as they come, whether or not its program reads them yet. A burst to a peer
that reads fine can still pass SEND_QUEUE for a moment (the peer's side tells ours what it has
taken only now and then), so what does not fit waits here, in order, and goes out as the peer
takes what came before. Only a peer that does not read at all (a stranger that stopped reading
its socket, a stopped process) makes it grow: past `limit_bytes`, or unmoved for STUCK_S, the
dispatcher drops that peer (Dispatcher._drop_peers_not_reading) and what waited for it.

Without this bound (SNDHWM 0, before issue 37), a client that asked for 64 MiB 38 times and read
nothing took the dispatcher to 2.5 GB.
"""

from __future__ import annotations

from collections import deque

import zmq

SEND_QUEUE = 16  # messages ZeroMQ holds for one peer; more wait in the Backlog
STUCK_S = 30.0  # a backlog that has not moved in this long belongs to a peer that does not read


def least_limit_bytes(max_message_bytes: int) -> int:
    """Per peer: two of the largest messages, and never less than 16 MiB."""
    return max(16 << 20, 2 * max_message_bytes)


def _size(frames: list) -> int:
    return sum(frame.nbytes if isinstance(frame, memoryview) else len(frame) for frame in frames)


class Backlog:
    def __init__(self, sock: zmq.Socket, limit_bytes: int):
        self.sock, self.limit_bytes = sock, limit_bytes
        self.waiting: dict[bytes, deque[list]] = {}
        self.bytes: dict[bytes, int] = {}
        self.moved: dict[bytes, float] = {}  # when the peer last took a message of its backlog
        self.over: set[bytes] = set()  # peers whose backlog went past limit_bytes

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def send(self, identity: bytes, frames: list, now: float) -> None:
        """Send `frames` to the peer now, or after what waits for it."""
        if identity not in self.waiting:
            if self._try(identity, frames):
                return
            self.waiting[identity], self.bytes[identity], self.moved[identity] = deque(), 0, now
        self.waiting[identity].append(frames)
        self.bytes[identity] += _size(frames)
        if self.bytes[identity] > self.limit_bytes:
            self.over.add(identity)

    def not_reading(self, now: float) -> list[tuple[bytes, str]]:
        """Send what waits, as far as each peer takes it; -> (peer, why it is dropped) for each
        peer that does not read (over the limit, or stuck), forgotten here."""
        for identity, queue in list(self.waiting.items()):
            while queue and self._try(identity, queue[0]):
                self.bytes[identity] -= _size(queue.popleft())
                self.moved[identity] = now
            if not queue:
                self._forget(identity)
            elif now - self.moved[identity] > STUCK_S:
                self.over.add(identity)
        found = [(identity, f"it does not read what is sent to it: {self.bytes.get(identity, 0) / 2**20:.1f} MiB "
                            f"waited for it (the bound: {self.limit_bytes >> 20} MiB, or {STUCK_S:g}s without taking any)")
                 for identity in self.over]
        for identity in self.over:
            self._forget(identity)
        self.over.clear()
        return found

    def _forget(self, identity: bytes) -> None:
        self.waiting.pop(identity, None)
        self.bytes.pop(identity, None)
        self.moved.pop(identity, None)

    def _try(self, identity: bytes, frames: list) -> bool:
        """Hand the message to ZeroMQ unless its queue for the peer is full; True if handed (or
        the peer is gone: ROUTER_MANDATORY says so, and liveness checks deal with it)."""
        try:
            self.sock.send_multipart([identity, *frames], copy=False, flags=zmq.DONTWAIT)
        except zmq.Again:
            return False
        except zmq.ZMQError:
            pass
        return True

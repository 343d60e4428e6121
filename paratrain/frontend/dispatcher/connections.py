"""The dispatcher's connections, each known by its file descriptor, and the end of those that
never join.

ZeroMQ's ROUTER socket neither says when a connection opens nor lets its program close one, so
left alone, a peer that connects and then says nothing (or only hello) holds a descriptor, and
some memory, for as long as it likes: enough of them exhaust the descriptors (`ulimit -n`) and
lock every real client out. What ZeroMQ does offer: a monitor socket says when a connection is accepted and when
it ends (both events carry its descriptor), every message says which descriptor it came on
(SRCFD), and shutting a descriptor down makes libzmq close that connection as if the peer had.

So each accepted connection is "unjoined" until a message on it comes from a client, a worker or
a monitor (or a client's heartbeat connection with a live client's secret). An unjoined
connection is shut after `join_s` (JOIN_S unless `serve --join-timeout` says) of the dispatcher's
own running time, and beyond MAX_UNJOINED the oldest are shut at once; both say so (through the
dispatcher's rate-limited complaints).
"""

from __future__ import annotations

import socket
from collections import OrderedDict

import zmq
from zmq.utils.monitor import recv_monitor_message

JOIN_S = 10.0  # the default time for a connection's peer to join (a real one takes milliseconds)
MAX_UNJOINED = 256  # connections that have not joined, at most; beyond, the oldest are shut
# A handshake refused for its content (a wrong key, no CURVE at all). Not NO_DETAIL: that is a
# connection closed mid-handshake, by its peer or by shut_unjoined below.
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | _HANDSHAKE_FAILED


class Connections:
    def __init__(self, sock: zmq.Socket, join_s: float = JOIN_S):
        self.sock, self.join_s = sock, join_s
        self.monitor = sock.get_monitor_socket(_EVENTS)
        # descriptor -> (when accepted, in the dispatcher's time; the peer's address then)
        self.unjoined: OrderedDict[int, tuple[float, object]] = OrderedDict()
        self.failed_handshakes = 0  # since last said (with a token: peers without it, or with another)

    def read_events(self, now: float) -> None:
        while self.monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(self.monitor)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.unjoined[fd] = (now, _peer_of(fd))
                self.unjoined.move_to_end(fd)
            elif event["event"] & _HANDSHAKE_FAILED:  # libzmq closes the connection itself
                self.failed_handshakes += 1
            else:
                self.unjoined.pop(fd, None)

    def joined(self, frame: zmq.Frame, now: float) -> None:
        """A message from a peer that has joined came on this frame's connection. (The monitor's
        events are read first: a peer joins within milliseconds of connecting, before a tick
        would have read that its connection was accepted.)"""
        self.read_events(now)
        if self.unjoined:
            try:
                self.unjoined.pop(frame.get(zmq.SRCFD), None)
            except zmq.ZMQError:
                pass

    def excuse(self, seconds: float) -> None:
        """The dispatcher was stalled: that time does not count against any connection."""
        for fd, (since, peer) in self.unjoined.items():
            self.unjoined[fd] = (since + seconds, peer)

    def shut_unjoined(self, now: float) -> list[tuple[str, str]]:
        """Shut connections unjoined past join_s, and the oldest beyond MAX_UNJOINED;
        -> (kind, line) to say for each of those and for handshakes refused since the last call."""
        self.read_events(now)
        late = [fd for fd, (since, _) in self.unjoined.items() if now - since > self.join_s]
        over = max(0, len(self.unjoined) - len(late) - MAX_UNJOINED)
        oldest = [fd for fd in self.unjoined if fd not in late][:over]
        for fd in (*late, *oldest):
            _, peer = self.unjoined.pop(fd)
            _shut(fd, peer)
        said = []
        if self.failed_handshakes:
            said.append(("handshake", f"refused {self.failed_handshakes} connection(s) in the encrypted handshake: "
                                      "a peer without this server's token, or with another"))
            self.failed_handshakes = 0
        if late:
            said.append(("unjoined", f"closed {len(late)} connection(s) whose peer did not join within "
                                     f"{self.join_s:g}s"))
        if oldest:
            said.append(("unjoined cap", f"closed the {len(oldest)} oldest of the connections that have not joined: "
                                         f"at most {MAX_UNJOINED} are kept"))
        return said

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)


def _peer_of(fd: int):
    """The remote address on descriptor `fd` (None if it is not a connected socket now)."""
    try:
        probe = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return probe.getpeername()
    except OSError:
        return None
    finally:
        probe.detach()  # the descriptor stays libzmq's


def _shut(fd: int, peer) -> None:
    """Shut the connection down (libzmq then closes it) if `fd` is still the connection it was:
    the same peer address, so a descriptor since reused is never touched."""
    if peer is None:
        return
    try:
        probe = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        if probe.getpeername() == peer:
            probe.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        probe.detach()

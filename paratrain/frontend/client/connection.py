"""A client's connection to its dispatcher: the sockets, joining, and knowing when it is lost.

Two sockets. The main one carries the instruction stream and its replies. The heartbeat one,
on a daemon thread, says "alive" every second, so that the dispatcher can tell a client that
died from one that is thinking; if the dispatcher answers that it has dropped this client (it
was silent past `--client-timeout`), the next call raises `ConnectionLost` with its reason.
The heartbeat connection also tells the client when its dispatcher is gone, instead of letting
it wait PARATRAIN_TIMEOUT for a reply that will never come: ZeroMQ's own heartbeats (ZMTP PING
and PONG, answered by the dispatcher's I/O thread, so a dispatcher busy in Python, or a long read
on the main connection, still answers) drop the connection when the dispatcher's host stops
answering, and a dispatcher that exits closes it at once. A connection down for RECONNECT_S
means the dispatcher is lost: within 10 s of its end in all.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import zmq
import zmq.utils.monitor

from paratrain.frontend.errors import ConnectionLost, DispatcherUnreachable, ProtocolError
from paratrain.frontend.protocol import VERSION, codec, messages
from paratrain.frontend.protocol.addresses import endpoint
from paratrain.frontend.protocol.fields import MalformedMessage
from paratrain.frontend.protocol.auth import secure_connector
from paratrain.frontend.protocol.handshake import ACCEPTS, join

HEARTBEAT_S = 1.0
PING_S, PONG_TIMEOUT_S = 1.0, 4.0  # ZMTP heartbeats on the heartbeat connection
RECONNECT_S = 2.0  # a dropped connection not back within this is a lost dispatcher
_ACCEPTS = ACCEPTS["client"]


class Connection:
    def __init__(self, address: str, *, token: str | None, timeout: float, connect_timeout: float,
                 name: str | None = None):
        self.address, self.timeout = address, timeout
        self.endpoint = endpoint(address)
        self.server_alive = lambda: True  # set by whoever started the server, to fail fast
        self.lost: str | None = None  # why the dispatcher no longer serves us
        self.context = zmq.Context()
        self.token = token
        hello = messages.Hello("client", VERSION, os.getpid(), (name or os.path.basename(sys.argv[0] or "python"))[:256],
                               socket.gethostname()[:256], "", None)
        try:
            self.sock, self.welcome = join(self.context, self.endpoint, hello, token, connect_timeout, address)
        except BaseException:
            self.context.term()
            raise
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(self.welcome.secret,),
                                           name="frontend-heartbeat", daemon=True)
        self._heartbeat.start()

    def send(self, message) -> None:
        """Send without waiting. (A refusal sent to us meanwhile is read at the next receive,
        or by the heartbeat thread within seconds: polling here would cost every batch.)"""
        self.check()
        self.sock.send_multipart(codec.encode(message, codec.cuts(self.token)), copy=False)

    def check(self) -> None:
        """ConnectionLost if the dispatcher has said it dropped us."""
        if self.lost is not None:
            raise ConnectionLost(f"the dispatcher at {self.address} no longer serves this client: {self.lost}")

    def receive(self):
        """The dispatcher's next message; fails fast if its server has exited or dropped us."""
        waited = 0.0
        while not self.sock.poll(1000, zmq.POLLIN):
            waited += 1.0
            if self.lost is not None:
                self.check()
            if not self.server_alive():
                self.lost = "its server has exited (its messages are above)"
                self.check()
            if waited >= self.timeout:
                raise DispatcherUnreachable(f"no answer from the dispatcher at {self.address} within "
                                            f"{self.timeout:g}s (PARATRAIN_TIMEOUT sets the limit)")
        message = self._decode(self.sock.recv_multipart(copy=False))
        if isinstance(message, messages.Refused):
            self.lost = message.reason
            self.check()
        return message

    def _decode(self, frames):
        try:
            return codec.decode([getattr(frame, "buffer", frame) for frame in frames], _ACCEPTS)
        except MalformedMessage as error:
            raise ProtocolError(f"the dispatcher at {self.address} sent a message we cannot read: {error}") from None

    def _beat(self, secret: bytes) -> None:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_connector(sock, self.token)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(PING_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(PONG_TIMEOUT_S * 1000))
        events = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        alive = codec.encode(messages.Alive(secret))
        down_since = None  # when the connection dropped, while it is down
        try:
            while not self._stop_heartbeat.wait(HEARTBEAT_S):
                try:
                    sock.send_multipart(alive, zmq.NOBLOCK)
                except zmq.Again:  # nothing connected and the queue full: the connection's state says why
                    pass
                while sock.poll(0, zmq.POLLIN):  # the dispatcher answers only to say we are dropped
                    try:
                        reply = codec.decode(sock.recv_multipart(), _ACCEPTS)
                    except MalformedMessage:
                        continue
                    if isinstance(reply, messages.Refused):
                        self.lost = reply.reason
                while events.poll(0, zmq.POLLIN):
                    event = zmq.utils.monitor.recv_monitor_message(events)["event"]
                    down_since = time.monotonic() if event == zmq.EVENT_DISCONNECTED else None
                if down_since is not None and time.monotonic() - down_since > RECONNECT_S and self.lost is None:
                    self.lost = ("its connection dropped and did not come back: the dispatcher has stopped, or its "
                                 "host cannot be reached")
        finally:
            sock.disable_monitor()
            events.close(linger=0)
            sock.close(linger=0)

    def close(self, say_bye: bool = True) -> None:
        self._stop_heartbeat.set()
        self._heartbeat.join(timeout=5)
        try:
            if say_bye and self.lost is None:
                self.sock.send_multipart(codec.encode(messages.Bye()))
        finally:
            self.sock.close(linger=500)
            self.context.term()


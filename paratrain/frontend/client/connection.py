"""A client's connection to its dispatcher: the sockets, joining, and knowing when it is lost.

Two sockets. The main one carries the instruction stream and its replies. The heartbeat one,
on a daemon thread, says "alive" every second, so that the dispatcher can tell a client that
died from one that is thinking; if the dispatcher answers that it has dropped this client (it
was silent past `--client-timeout`), the next call raises `ConnectionLost` with its reason.
Heartbeats go both ways: the dispatcher answers each (Here), and a client that hears no answer
for DISPATCHER_SILENCE_S knows its dispatcher is gone, instead of waiting PARATRAIN_TIMEOUT for
a reply that will never come. A long read is not mistaken for it: the answers come on the
heartbeat connection, whatever the main one carries.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import zmq

from paratrain.frontend.errors import ConnectionLost, DispatcherUnreachable, ProtocolError
from paratrain.frontend.protocol import VERSION, codec, messages
from paratrain.frontend.protocol.addresses import endpoint
from paratrain.frontend.protocol.fields import MalformedMessage
from paratrain.frontend.protocol.handshake import ACCEPTS, handshake

HEARTBEAT_S = 1.0
DISPATCHER_SILENCE_S = 8.0  # with one beat's delay, a lost dispatcher is known within 10 s
_ACCEPTS = ACCEPTS["client"]


class Connection:
    def __init__(self, address: str, *, token: str | None, timeout: float, connect_timeout: float,
                 name: str | None = None):
        self.address, self.timeout = address, timeout
        self.endpoint = endpoint(address)
        self.server_alive = lambda: True  # set by whoever started the server, to fail fast
        self.lost: str | None = None  # why the dispatcher no longer serves us
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        hello = messages.Hello("client", VERSION, os.getpid(), (name or os.path.basename(sys.argv[0] or "python"))[:256],
                               socket.gethostname()[:256], "", None)
        try:
            self.welcome: messages.ClientWelcome = handshake(self.sock, hello, token, connect_timeout, address)
        except BaseException:
            self.sock.close(linger=0)
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
        self.sock.send_multipart(codec.encode(message), copy=False)

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
        sock.connect(self.endpoint)
        alive = codec.encode(messages.Alive(secret))
        heard = turn = time.monotonic()
        try:
            while not self._stop_heartbeat.wait(HEARTBEAT_S):
                if time.monotonic() - turn > 3 * HEARTBEAT_S:  # this process was held up, not the dispatcher:
                    heard = time.monotonic()  # its answers to beats never sent cannot be missed
                turn = time.monotonic()
                try:
                    sock.send_multipart(alive, zmq.NOBLOCK)
                except zmq.Again:  # nothing connected and the queue full: the silence says it
                    pass
                while sock.poll(0, zmq.POLLIN):  # read all before judging: this thread may have been held up
                    try:
                        reply = codec.decode(sock.recv_multipart(), _ACCEPTS)
                    except MalformedMessage:
                        continue
                    heard = time.monotonic()
                    if isinstance(reply, messages.Refused):
                        self.lost = reply.reason
                silent = time.monotonic() - heard
                if silent > DISPATCHER_SILENCE_S and self.lost is None:
                    self.lost = (f"it has not answered for {silent:.0f}s: it has stopped, or its host cannot be "
                                 f"reached")
        finally:
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


"""Joining a dispatcher, the peer's side: hello, then (when it has a token) the challenge, then
a welcome. Shared by clients, workers and monitors."""

from __future__ import annotations

import time

import zmq

from paratrain.frontend.errors import AuthenticationError, DispatcherUnreachable, ProtocolError
from paratrain.frontend.protocol import codec, messages
from paratrain.frontend.protocol.auth import auth_mac
from paratrain.frontend.protocol.fields import MalformedMessage

WELCOMES = {"client": messages.ClientWelcome, "worker": messages.WorkerWelcome, "monitor": messages.MonitorWelcome}
ACCEPTS = {"client": codec.decoder(messages.TO_CLIENT), "worker": codec.decoder(messages.TO_WORKER),
           "monitor": codec.decoder(messages.TO_MONITOR)}


def handshake(sock, hello: messages.Hello, token: str | None, timeout: float | None, address: str,
              on_wait=None):
    """Introduce this peer and return the dispatcher's welcome. `timeout` bounds each wait for
    a reply; `on_wait(seconds)` is called every second while none has come (a worker prints
    that it is waiting)."""
    sock.send_multipart(codec.encode(hello))
    while True:
        reply = receive(sock, hello.role, timeout, address, on_wait)
        if isinstance(reply, WELCOMES[hello.role]):
            return reply
        if isinstance(reply, messages.Challenge):
            if not token:
                raise AuthenticationError(f"{address} requires a token: set PARATRAIN_TOKEN or pass token=... / --token")
            sock.send_multipart(codec.encode(messages.Auth(auth_mac(token, reply.nonce, hello.role))))
        elif isinstance(reply, messages.Refused):
            raise AuthenticationError(f"{address} refused the connection: {reply.reason}")
        elif isinstance(reply, messages.Error):
            raise ProtocolError(f"{address} could not take our hello: {reply.message}")
        elif not isinstance(reply, (messages.Waiting, messages.Ping)):  # a worker waits for the world
            raise ProtocolError(f"unexpected {reply.KIND!r} from {address} while connecting")


def receive(sock, role: str, timeout: float | None, address: str, on_wait=None):
    """The next message for a peer of `role`, decoded; DispatcherUnreachable after `timeout`."""
    started = time.monotonic()
    while True:
        waited = time.monotonic() - started
        if timeout is not None and waited >= timeout:
            raise DispatcherUnreachable(f"no reply from {address} within {timeout:g}s "
                                        "(is `paratrain serve` running there?)")
        left_ms = -1 if timeout is None else max(1, int((timeout - waited) * 1000))
        if sock.poll(min(1000, left_ms) if on_wait else left_ms, zmq.POLLIN):
            break
        if on_wait is not None:
            on_wait(time.monotonic() - started)
    try:
        return codec.decode(sock.recv_multipart(), ACCEPTS[role])
    except MalformedMessage as error:
        raise ProtocolError(f"{address} sent a message we cannot read: {error}") from None

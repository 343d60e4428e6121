"""Joining a dispatcher, the peer's side: hello, then (when it has a token) the challenge, then
a welcome. Shared by clients, workers and monitors."""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from paratrain.frontend.errors import AuthenticationError, DispatcherUnreachable, ProtocolError
from paratrain.frontend.protocol import codec, messages
from paratrain.frontend.protocol.auth import auth_mac, secure_connector
from paratrain.frontend.protocol.fields import MalformedMessage

WELCOMES = {"client": messages.ClientWelcome, "worker": messages.WorkerWelcome, "monitor": messages.MonitorWelcome}
ACCEPTS = {"client": codec.decoder(messages.TO_CLIENT), "worker": codec.decoder(messages.TO_WORKER),
           "monitor": codec.decoder(messages.TO_MONITOR)}


_REFUSED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def join(context: zmq.Context, endpoint: str, hello: messages.Hello, token: str | None, timeout: float | None,
         address: str, on_wait=None):
    """Connect a DEALER to the dispatcher at `endpoint` (with a token, over CURVE: auth.py),
    introduce this peer and return (the socket, the dispatcher's welcome). `timeout` bounds
    each wait for a reply; `on_wait(seconds)` is called every second while none has come (a
    worker prints that it is waiting). A transport handshake the dispatcher refuses (the token
    differs, or one side has none) is an AuthenticationError at once, not a wait."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        secure_connector(sock, token)
        # Watched from before the connection starts: a refusal for a missing token comes once.
        refusals = sock.get_monitor_socket(_REFUSED)
        try:
            sock.connect(endpoint)
            return sock, handshake(sock, hello, token, timeout, address, on_wait, refusals)
        finally:
            sock.disable_monitor()
            refusals.close(linger=0)
    except BaseException:
        sock.close(linger=0)
        raise


def handshake(sock, hello: messages.Hello, token: str | None, timeout: float | None, address: str,
              on_wait=None, refusals=None):
    """Introduce this peer on a connected socket and return the dispatcher's welcome
    (`refusals`: a monitor of failed transport handshakes, from join)."""
    sock.send_multipart(codec.encode(hello))
    while True:
        reply = receive(sock, hello.role, timeout, address, on_wait,
                        refusals=None if refusals is None else (refusals, token))
        if isinstance(reply, WELCOMES[hello.role]):
            return reply
        _answer(sock, reply, hello, token, address)


def _answer(sock, reply, hello: messages.Hello, token: str | None, address: str) -> None:
    """What a peer does with a message other than its welcome while it joins."""
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


def receive(sock, role: str, timeout: float | None, address: str, on_wait=None, refusals=None):
    """The next message for a peer of `role`, decoded; DispatcherUnreachable after `timeout`.
    `refusals`: (a monitor socket of failed transport handshakes, our token), read while waiting."""
    started = time.monotonic()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if refusals is not None:
        poller.register(refusals[0], zmq.POLLIN)
    while True:
        waited = time.monotonic() - started
        if timeout is not None and waited >= timeout:
            raise DispatcherUnreachable(f"no reply from {address} within {timeout:g}s "
                                        "(is `paratrain serve` running there?)")
        left_ms = -1 if timeout is None else max(1, int((timeout - waited) * 1000))
        ready = dict(poller.poll(min(1000, left_ms) if on_wait else left_ms))
        if refusals is not None and refusals[0] in ready:
            _raise_refusal(recv_monitor_message(refusals[0]), refusals[1], address)
        if sock in ready:
            break
        if on_wait is not None:
            on_wait(time.monotonic() - started)
    try:
        return codec.decode(sock.recv_multipart(), ACCEPTS[role])
    except MalformedMessage as error:
        raise ProtocolError(f"{address} sent a message we cannot read: {error}") from None


def _raise_refusal(event: dict, token: str | None, address: str) -> None:
    # Which side ends a failed handshake first is a race, so the event's detail (a mechanism
    # mismatch, or a plain closed connection) tells only part of the cause: our token tells more.
    if not token:
        raise AuthenticationError(f"{address} requires a token: set PARATRAIN_TOKEN or pass token=... / --token")
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
            event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        raise AuthenticationError(f"{address} takes no token (its server was started without one): "
                                  "leave PARATRAIN_TOKEN / token= / --token unset")
    raise AuthenticationError(f"{address} refused the connection: wrong token, or its server takes none "
                              "(the encrypted handshake failed)")

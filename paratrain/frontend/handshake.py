"""Joining a dispatcher: hello, then (when it has a token) an HMAC challenge, then welcome."""

from __future__ import annotations

import zmq

from paratrain.frontend import wire
from paratrain.frontend.errors import AuthenticationError, DispatcherUnreachable, ProtocolError


def handshake(sock, role: str, token: str | None, fields: dict, timeout: float | None,
              address: str = "the dispatcher") -> dict:
    """Introduce this peer as `role` and return the dispatcher's welcome (a dict)."""
    sock.send(wire.encode({"t": "hello", "role": role, "v": wire.PROTOCOL_VERSION, **fields}))
    while True:
        reply = receive(sock, timeout, address)
        kind = reply["t"]
        if kind == "welcome":
            return reply
        if kind == "challenge":
            if not token:
                raise AuthenticationError(
                    f"{address} requires a token: set PARATRAIN_TOKEN or pass token=... / --token"
                )
            nonce = wire.field(reply, "nonce", bytes)
            sock.send(wire.encode({"t": "auth", "mac": wire.auth_mac(token, nonce, role)}))
        elif kind == "refused":
            raise AuthenticationError(f"{address} refused the connection: {reply.get('reason')}")
        elif kind not in ("waiting", "ping"):  # a worker waits here for the whole world
            raise ProtocolError(f"unexpected {kind!r} from {address} while connecting")


def receive(sock, timeout: float | None, address: str) -> dict:
    if timeout is not None and not sock.poll(int(timeout * 1000), zmq.POLLIN):
        raise DispatcherUnreachable(
            f"no reply from {address} within {timeout:g}s (is `paratrain serve` running there?)"
        )
    return wire.decode(sock.recv())

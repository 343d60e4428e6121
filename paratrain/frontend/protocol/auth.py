"""Authentication over a shared token: ZeroMQ's CURVE handshake, then a challenge-response.

The dispatcher sends a random nonce; the peer answers HMAC-SHA256(token, nonce || role). The
token never crosses the wire, and an answer is good for one nonce and one role only. Beneath it,
the transport's own handshake shuts out anyone without the token before a message is read (below).
"""

from __future__ import annotations

import hashlib
import hmac
import os

import zmq
from zmq.utils import z85


def new_nonce() -> bytes:
    return os.urandom(32)


def auth_mac(token: str, nonce: bytes, role: str) -> str:
    return hmac.new(token.encode(), nonce + role.encode(), hashlib.sha256).hexdigest()


def auth_ok(token: str, nonce: bytes, role: str, mac: object) -> bool:
    # compare_digest refuses str with non-ASCII characters (TypeError): such a mac is wrong, not an error
    return isinstance(mac, str) and mac.isascii() and hmac.compare_digest(auth_mac(token, nonce, role), mac)


# ---- the encrypted transport ----------------------------------------------------------------------
#
# With a token, every connection to the dispatcher also runs ZeroMQ's CURVE handshake, with keys
# derived from the token. The challenge above proves a peer only after its first message has
# arrived whole, and libzmq buffers a message of any number of frames before the program sees any
# of it (ZMQ_MAXMSGSIZE bounds one frame): a stranger could make the dispatcher hold gigabytes.
# CURVE refuses a peer inside the handshake, whose commands are a few hundred bytes, before any
# message is read. The server's key pair comes from the token, and its public key never crosses
# the wire (a client must already hold it), so only a peer that knows the token gets past the
# handshake's first command. The traffic is encrypted too.

_KEY_PERSON = {"server": b"paratrain-server", "client": b"paratrain-client"}


def _key_pair(token: str, side: str) -> tuple[bytes, bytes]:
    """(public, secret), Z85-encoded, of `side`'s key pair for this token."""
    seed = hashlib.blake2b(token.encode(), digest_size=32, person=_KEY_PERSON[side]).digest()
    secret = z85.encode(seed)  # any 32 bytes are a Curve25519 secret key (the library clamps them)
    return zmq.curve_public(secret), secret


def secure_listener(sock: zmq.Socket, token: str | None) -> None:
    """With a token, `sock` (not yet bound) admits only peers that hold the same token."""
    if token:
        _need_curve()
        public, secret = _key_pair(token, "server")
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = public, secret


def secure_connector(sock: zmq.Socket, token: str | None) -> None:
    """With a token, `sock` (not yet connected) proves it in the handshake and encrypts."""
    if token:
        _need_curve()
        sock.curve_serverkey = _key_pair(token, "server")[0]
        sock.curve_publickey, sock.curve_secretkey = _key_pair(token, "client")


def _need_curve() -> None:
    if not zmq.has("curve"):
        raise RuntimeError("a token needs ZeroMQ built with CURVE security, and this pyzmq's libzmq has none "
                           "(zmq.has('curve') is False): install pyzmq's own wheel")

"""Authentication: a challenge-response over a shared token.

The dispatcher sends a random nonce; the peer answers HMAC-SHA256(token, nonce || role). The
token never crosses the wire, and an answer is good for one nonce and one role only.
"""

from __future__ import annotations

import hashlib
import hmac
import os


def new_nonce() -> bytes:
    return os.urandom(32)


def auth_mac(token: str, nonce: bytes, role: str) -> str:
    return hmac.new(token.encode(), nonce + role.encode(), hashlib.sha256).hexdigest()


def auth_ok(token: str, nonce: bytes, role: str, mac: object) -> bool:
    # compare_digest refuses str with non-ASCII characters (TypeError): such a mac is wrong, not an error
    return isinstance(mac, str) and mac.isascii() and hmac.compare_digest(auth_mac(token, nonce, role), mac)

"""The frontend's wire format: what travels between client, dispatcher and workers.

Every message is a ZeroMQ multipart message. Its first frame is a msgpack map with a type
field `t`; tensors the client uploads or fetches follow as raw frames, described in the map by
dtype and shape (no pickle anywhere: msgpack decodes only nil, bools, numbers, strings, bytes,
lists and maps). Decoding is bounded (lengths of strings, lists and maps) and a message that
does not decode, or whose map lacks its type, raises `MalformedMessage`.

Authentication is a challenge-response: the dispatcher sends a random nonce, the peer answers
with HMAC-SHA256(token, nonce || role). The token itself never crosses the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
MAX_STR = 1 << 16  # operation names, error texts, source lines
MAX_ARRAY = 1 << 20  # instructions in a batch, handles in a free list
MAX_MAP = 1 << 12
DEFAULT_MAX_MESSAGE_MB = 1024  # one uploaded or fetched tensor; also ZeroMQ's per-frame limit


class MalformedMessage(ValueError):
    """A message that is not msgpack, not a map, or lacks the fields its type needs."""


def encode(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def decode(frame: bytes) -> dict:
    try:
        header = msgpack.unpackb(
            frame, raw=False, strict_map_key=False, max_str_len=MAX_STR,
            max_bin_len=MAX_STR, max_array_len=MAX_ARRAY, max_map_len=MAX_MAP,
            max_ext_len=0,
        )
    except Exception as error:  # noqa: BLE001 - any decoding failure is the sender's fault
        raise MalformedMessage(f"not a msgpack message ({type(error).__name__}: {error})") from None
    if not isinstance(header, dict) or not isinstance(header.get("t"), str):
        raise MalformedMessage("a message must be a msgpack map with a string field 't'")
    return header


def field(header: dict, name: str, kind, optional: bool = False):
    """`header[name]`, checked to be of `kind` (a type or tuple of types)."""
    if name not in header:
        if optional:
            return None
        raise MalformedMessage(f"{header['t']!r} message lacks field {name!r}")
    value = header[name]
    if optional and value is None:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and bool not in _as_tuple(kind):
        raise MalformedMessage(f"{header['t']!r} message: field {name!r} has the wrong type")
    return value


def _as_tuple(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


# ---- tensors as raw bytes --------------------------------------------------------------------

# The dtypes a tensor may have on the wire. bfloat16 has no numpy type: it travels as its raw
# 2 bytes per element and is widened to float32 when the client reads it.
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
NUMPY_DTYPES = {name: np.dtype(name) for name in DTYPES if name != "bfloat16"}
NUMPY_DTYPES["bfloat16"] = np.dtype("uint16")


def numpy_dtype_name(array: np.ndarray) -> str:
    name = array.dtype.name
    if name not in NUMPY_DTYPES:
        raise TypeError(f"numpy dtype {name} has no frontend equivalent; use one of {', '.join(DTYPES)}")
    return name


def array_from_frame(buffer, dtype: str, shape: list[int]) -> np.ndarray:
    """A writable numpy array from a fetched tensor's bytes (bfloat16 widened to float32)."""
    if dtype not in NUMPY_DTYPES:
        raise MalformedMessage(f"unknown dtype {dtype!r}")
    array = np.frombuffer(buffer, dtype=NUMPY_DTYPES[dtype]).copy()
    if dtype == "bfloat16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    expected = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if array.size != expected:
        raise MalformedMessage(f"tensor frame holds {array.size} elements, its header says {shape}")
    return array.reshape(shape)


# ---- authentication ---------------------------------------------------------------------------

def new_nonce() -> bytes:
    return os.urandom(32)


def auth_mac(token: str, nonce: bytes, role: str) -> str:
    return hmac.new(token.encode(), nonce + role.encode(), hashlib.sha256).hexdigest()


def auth_ok(token: str, nonce: bytes, role: str, mac: object) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(auth_mac(token, nonce, role), mac)


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def split_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port), with a readable error."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"server address must look like HOST:PORT, got {address!r}")
    return host, int(port)

"""Messages to ZeroMQ frames and back: the one place that packs and unpacks.

A message is a multipart ZeroMQ message: its first part a msgpack map, `{"t": kind, field:
value, ...}`, and then the raw bytes of any tensors it carries, a frame each.

With a token, what travels toward the dispatcher is cut: a part of n bytes goes as
n // PIECE_BYTES frames of PIECE_BYTES and one shorter (maybe empty) frame, so a frame shorter
than a piece ends a part, and a part under PIECE_BYTES is one frame as it is. Such a dispatcher
takes no frame over PIECE_BYTES (ZMQ_MAXMSGSIZE), which is then all that a stranger still in
ZeroMQ's handshake can make it hold, however large the tensors its peers exchange. Without a
token there are no strangers to fear (the dispatcher listens on loopback, and anyone there may
join), and what the dispatcher sends is never cut (its peers set no cap): joining pieces costs a
copy, about a fifth of a large tensor's trip. msgpack decodes only nil, bools,
numbers, strings, bytes, lists and maps (no pickle, no extension types), and decoding is
bounded: the header's size, and the lengths of its strings, lists and maps. `decode` then
checks the kind against the messages this receiver accepts and every field against its spec.
"""

from __future__ import annotations

from dataclasses import fields as dataclass_fields
from typing import NamedTuple

import msgpack

from paratrain.frontend.protocol.fields import MalformedMessage

MAX_HEADER = 64 << 20  # bytes of one header (a batch of instructions, a list of freed handles)
PIECE_BYTES = 256 << 10  # the largest frame a part travels in
MAX_STR = 1 << 16
MAX_ARRAY = 1 << 20
MAX_MAP = 1 << 12


class Layout(NamedTuple):
    """How a message class travels, worked out once per class."""
    fields: list  # the header's fields: (name, check, its arguments, the name errors give it)
    names: tuple  # the header's field names, in order
    name_set: frozenset
    carries_frames: bool  # tensor bytes follow the header


def _layout(cls) -> Layout:
    header, carries_frames = [], False
    for spec in dataclass_fields(cls):
        if spec.metadata.get("frames"):
            carries_frames = True
        else:
            header.append((spec.name, spec.metadata["check"], spec.metadata["args"], f"{cls.KIND}.{spec.name}"))
    names = tuple(name for name, *_ in header)
    return Layout(header, names, frozenset(names), carries_frames)


_LAYOUTS: dict = {}


def layout(cls) -> Layout:
    found = _LAYOUTS.get(cls)
    if found is None:
        found = _LAYOUTS[cls] = _layout(cls)
    return found


def cuts(token: str | None) -> bool:
    """Whether parts toward a dispatcher travel cut into pieces: with a token (see the top)."""
    return bool(token)


def encode(message, cut: bool = False) -> list:
    """The frames of `message`: its header, then its frames (tensor bytes), if it has any; each
    cut into pieces with `cut` (toward a dispatcher with a token)."""
    shape = layout(type(message))
    header = {"t": message.KIND}
    for name in shape.names:
        header[name] = getattr(message, name)
    packed = msgpack.packb(header, use_bin_type=True)
    if not shape.carries_frames:
        return pieces(packed) if cut else [packed]
    if not cut:
        return [packed, *message.frames]
    return [piece for part in (packed, *message.frames) for piece in pieces(part)]


def pieces(part) -> list:
    """The frames one part (bytes-like) travels in (see the top of this file)."""
    view = memoryview(part)
    if view.nbytes < PIECE_BYTES:
        return [part]
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    whole = view.nbytes - view.nbytes % PIECE_BYTES
    return [view[start:start + PIECE_BYTES] for start in range(0, whole, PIECE_BYTES)] + [view[whole:]]


def _size(frame) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def parts(frames: list) -> list:
    """The parts that `frames` carry (a received message's frames, bytes-like). Frames are
    joined only where a part was cut."""
    if all(_size(frame) != PIECE_BYTES for frame in frames):
        return frames  # the common case: every part is one frame
    joined, pending = [], []
    for frame in frames:
        if _size(frame) == PIECE_BYTES:
            pending.append(frame)
            continue
        if pending:
            frame, pending = b"".join([*pending, frame]), []
        joined.append(frame)
    if pending:
        raise MalformedMessage(f"a message ends inside a part ({len(pending)} full frames, no last frame)")
    return joined


def decoder(accepted) -> dict:
    """{kind: class} for a receiver that accepts the message classes `accepted`."""
    return {cls.KIND: cls for cls in accepted}


def peek(frames: list, count_of: str | None = None) -> tuple[str | None, int]:
    """(type of a message, length of its list field `count_of`), read without decoding the
    rest: a receiver's I/O thread routes on it and leaves the decoding to the thread that
    handles the message. (None, 0) when there is nothing to read; decoding will say why."""
    kind, count = None, 0
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(frames[0]) + 1)
        unpacker.feed(frames[0])
        entries = unpacker.read_map_header()
        for _ in range(entries):
            key = unpacker.unpack()
            if key == "t":
                kind = unpacker.unpack()
            elif key == count_of:
                count = unpacker.read_array_header()
                break
            else:
                unpacker.skip()
            if kind is not None and count_of is None:
                break
    except Exception:  # noqa: BLE001 - not a message we can route
        return None, 0
    return (kind if type(kind) is str else None), count


def decode(frames: list, accepted: dict, max_header: int = MAX_HEADER, max_part: int | None = None,
           cut: bool = False):
    """A message from `frames` (bytes-like, as received), of a kind in `accepted` ({kind:
    class}), with every field checked. MalformedMessage (naming the field) otherwise.
    `max_part`: the most bytes one tensor may carry; `cut`: its parts came cut into pieces."""
    if not frames:
        raise MalformedMessage("an empty message")
    if cut:
        frames = parts(frames)
    if max_part is not None and any(_size(frame) > max_part for frame in frames[1:]):
        largest = max(_size(frame) for frame in frames[1:])
        raise MalformedMessage(f"a tensor of {largest} bytes (at most {max_part} here: --max-message-mb)")
    head = frames[0]
    if len(head) > max_header:
        raise MalformedMessage(f"a header of {len(head)} bytes (at most {max_header} here)")
    try:
        body = msgpack.unpackb(head, raw=False, strict_map_key=False, max_str_len=MAX_STR, max_bin_len=MAX_STR,
                               max_array_len=MAX_ARRAY, max_map_len=MAX_MAP, max_ext_len=0)
    except Exception as error:  # noqa: BLE001 - whatever does not decode is the sender's fault
        raise MalformedMessage(f"not a msgpack message ({type(error).__name__}: {str(error)[:200]})") from None
    if type(body) is not dict:
        raise MalformedMessage("a message must be a msgpack map")
    kind = body.pop("t", None)
    cls = accepted.get(kind) if type(kind) is str else None
    if cls is None:
        raise MalformedMessage(f"unknown message type {str(kind)[:64]!r} (this side takes: {', '.join(accepted)})", "t")
    shape = layout(cls)
    if len(body) != len(shape.names) or not shape.name_set.issuperset(body):
        missing = sorted(shape.name_set - body.keys())
        extra = sorted(str(key)[:64] for key in body if key not in shape.name_set)
        raise MalformedMessage(f"{kind} message: missing {missing or 'nothing'}, unexpected {extra or 'nothing'}")
    values = [check(body[name], where, *args) for name, check, args, where in shape.fields]
    if not shape.carries_frames:
        if len(frames) > 1:
            raise MalformedMessage(f"a {kind} message carries no frames, got {len(frames) - 1}")
        return cls(*values)
    message = cls(*values, frames=list(frames[1:]))
    message.check_frames()
    return message

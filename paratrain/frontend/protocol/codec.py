"""Messages to ZeroMQ frames and back: the one place that packs and unpacks.

A message is a multipart ZeroMQ message: its first frame a msgpack map, `{"t": kind, field:
value, ...}`, and then the raw bytes of any tensors it carries. msgpack decodes only nil, bools,
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


def encode(message) -> list:
    """The frames of `message`: its header, then its frames (tensor bytes), if it has any."""
    shape = layout(type(message))
    header = {"t": message.KIND}
    for name in shape.names:
        header[name] = getattr(message, name)
    packed = msgpack.packb(header, use_bin_type=True)
    return [packed, *message.frames] if shape.carries_frames else [packed]


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


def decode(frames: list, accepted: dict, max_header: int = MAX_HEADER):
    """A message from `frames` (bytes-like), of a kind in `accepted` ({kind: class}), with every
    field checked. MalformedMessage (naming the field) otherwise."""
    if not frames:
        raise MalformedMessage("an empty message")
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
    message = cls(*values, list(frames[1:]))
    message.check_frames()
    return message

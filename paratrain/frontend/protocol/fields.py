"""Checks for the fields of a message: each takes a decoded value and returns it (or a
normalised copy), or raises `MalformedMessage` naming the field and what it must be.

msgpack gives back only nil, bools, ints, floats, strings, bytes, lists and maps; a check
decides which of those a field may hold, and how large. Bools are not ints here (msgpack keeps
them apart, and `True` as a worker number is a mistake, not a 1).
"""

from __future__ import annotations

import math

INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_TEXT = 1 << 16  # error messages, reasons


class MalformedMessage(ValueError):
    """A message that does not decode, or one of whose fields is not what its type says.
    `field` names the field (dotted into lists and maps) when one is to blame."""

    def __init__(self, text: str, field: str | None = None):
        super().__init__(f"field {field!r}: {text}" if field else text)
        self.field = field


def _fail(field: str, must: str, value) -> MalformedMessage:
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return MalformedMessage(f"must be {must}, got {type(value).__name__} {shown}", field)


def integer(value, field: str, low: int = INT64[0], high: int = INT64[1]) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _fail(field, f"an integer in [{low}, {high}]", value)
    return value


def number(value, field: str, finite: bool = True) -> float:
    """An int or a float (NaN and infinities only where `finite` is False)."""
    if type(value) not in (int, float) or (finite and not math.isfinite(value)):
        raise _fail(field, "a finite number" if finite else "a number", value)
    return value


def flag(value, field: str) -> bool:
    if type(value) is not bool:
        raise _fail(field, "true or false", value)
    return value


def text(value, field: str, max_len: int = 256) -> str:
    if type(value) is not str or len(value) > max_len:
        raise _fail(field, f"a string of at most {max_len} characters", value)
    return value


def raw(value, field: str, length: int | None = None, max_len: int = 256) -> bytes:
    if type(value) is not bytes or (len(value) != length if length is not None else len(value) > max_len):
        must = f"{length} bytes" if length is not None else f"at most {max_len} bytes"
        raise _fail(field, must, value)
    return value


def one_of(value, field: str, choices) -> str:
    if type(value) is not str or value not in choices:
        raise _fail(field, f"one of {', '.join(sorted(choices))}", value)
    return value


def optional(value, field: str, check, *args):
    """None, or what `check` accepts."""
    return None if value is None else check(value, field, *args)


def items(value, field: str, max_len: int) -> list:
    """A list of at most `max_len` items (each checked by the caller)."""
    if type(value) is not list or len(value) > max_len:
        raise _fail(field, f"a list of at most {max_len} items", value)
    return value


def integers(value, field: str, max_len: int, low: int = INT64[0], high: int = INT64[1]) -> list[int]:
    for i, item in enumerate(items(value, field, max_len)):
        if type(item) is not int or not low <= item <= high:
            raise _fail(f"{field}[{i}]", f"an integer in [{low}, {high}]", item)
    return value


def texts(value, field: str, max_len: int, max_chars: int = 256) -> list[str]:
    for i, item in enumerate(items(value, field, max_len)):
        text(item, f"{field}[{i}]", max_chars)
    return value


def mapping(value, field: str, max_len: int) -> dict:
    if type(value) is not dict or len(value) > max_len:
        raise _fail(field, f"a map of at most {max_len} entries", value)
    return value


# ---- plain values: the arguments of an operation ---------------------------------------------

MAX_PLAIN_LIST = 1024  # items in one list argument (a shape, an index, a group of workers)
MAX_PLAIN_TEXT = 64


def plain(value, field: str, depth: int = 2):
    """An argument value: nil, a bool, an int64, a float, a short string, or a list of these
    (lists nest at most `depth` deep: an index item ["s", start, stop, step] inside an index)."""
    kind = type(value)
    if value is None or kind is bool or kind is float:
        return value
    if kind is int:
        if not INT64[0] <= value <= INT64[1]:
            raise _fail(field, "a 64-bit integer", value)
        return value
    if kind is str:
        if len(value) > MAX_PLAIN_TEXT:
            raise _fail(field, f"a string of at most {MAX_PLAIN_TEXT} characters", value)
        return value
    if kind is list and depth > 0 and len(value) <= MAX_PLAIN_LIST:
        for i, item in enumerate(value):
            plain(item, f"{field}[{i}]", depth - 1)
        return value
    raise _fail(field, "a number, bool, nil, short string, or a list of them (lists nest two deep)", value)

"""How a Python index (`x[1:, None, idx]`) travels: as msgpack-able items, decoded on the worker
(and by the dispatcher's getitem sharding rule) back into the same index."""

from __future__ import annotations

import torch


def encode_index(index) -> list:
    """A Python index (ints, slices, None, Ellipsis, tensors) as msgpack-able items; tensors stay
    in place for the caller to turn into handles."""
    items = index if isinstance(index, tuple) else (index,)
    encoded = []
    for item in items:
        if isinstance(item, slice):
            encoded.append(["s", item.start, item.stop, item.step])
        elif item is Ellipsis:
            encoded.append(["e"])
        elif item is None or isinstance(item, (bool, int)) or hasattr(item, "_handle"):
            encoded.append(item)
        else:
            raise TypeError(f"unsupported index {item!r}: use ints, slices, None, ... or integer tensors")
    return encoded


def decode_index(items) -> tuple:
    decoded = []
    for item in items:
        if isinstance(item, list) and item and item[0] == "s" and len(item) == 4:
            decoded.append(slice(item[1], item[2], item[3]))
        elif isinstance(item, list) and item == ["e"]:
            decoded.append(Ellipsis)
        elif item is None or isinstance(item, (bool, int, torch.Tensor)):
            decoded.append(item)
        else:
            raise ValueError(f"malformed index item {item!r}")
    return tuple(decoded)

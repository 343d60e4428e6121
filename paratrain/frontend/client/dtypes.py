"""A client tensor's dtype: its name, as GT's are, equal to NumPy's dtype of that name."""

from __future__ import annotations

import numpy as np

from paratrain.frontend.ops import FLOATING


def floating(dtype: str) -> bool:
    return dtype in FLOATING


class DType(str):
    """A dtype's name ("float32") that also equals NumPy's dtype of that name (`np.float32`,
    `np.dtype("float32")`), as GT's dtypes do; bfloat16, which NumPy lacks, equals its name only."""

    __slots__ = ()

    def __eq__(self, other):
        if isinstance(other, str):
            return str.__eq__(self, other)
        try:
            return np.dtype(other).name == self
        except TypeError:
            return NotImplemented

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = str.__hash__


_DTYPE_OBJECTS: dict[str, DType] = {}


def dtype_named(name: str) -> DType:
    """The one DType object of each name (made once: tensors are created on every operation)."""
    found = _DTYPE_OBJECTS.get(name)
    if found is None:
        found = _DTYPE_OBJECTS.setdefault(name, DType(name))
    return found

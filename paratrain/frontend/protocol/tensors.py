"""Tensors as raw frames: the dtypes that may travel, numpy arrays from their bytes, and the
parts a split tensor travels in.

bfloat16 has no numpy type: it travels as its raw 2 bytes per element and is widened to
float32 when the client reads it.
"""

from __future__ import annotations

import numpy as np

from paratrain.frontend.ops import DTYPES
from paratrain.frontend.protocol.fields import MalformedMessage

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
    if len(buffer) % NUMPY_DTYPES[dtype].itemsize:
        raise MalformedMessage(f"a {dtype} frame of {len(buffer)} bytes")
    array = np.frombuffer(buffer, dtype=NUMPY_DTYPES[dtype]).copy()
    if dtype == "bfloat16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    expected = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if array.size != expected:
        raise MalformedMessage(f"tensor frame holds {array.size} elements, its header says {shape}")
    try:
        return array.reshape(shape)
    except ValueError as error:  # an empty shape numpy cannot describe: [0, 2**63 - 1]
        raise ValueError(f"numpy cannot hold a {dtype} array of shape {shape}: {error}") from None


def part_sizes(length: int, parts: int) -> list[int]:
    """The lengths of a split axis' parts, as torch.tensor_split cuts them: the first
    `length % parts` parts are one longer."""
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]

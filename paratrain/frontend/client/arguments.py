"""One argument as GT (NumPy) or PyTorch spells it, read once: `axis` or `dim`, `keepdims` or
`keepdim`, a shape as one tuple or as several ints."""

from __future__ import annotations


def dim_or_axis(dim, axis):
    return axis if axis is not None else dim


def keep_dims(keepdim, keepdims) -> bool:
    return bool(keepdims) if keepdims is not None else bool(keepdim)


def shape_args(shape: tuple) -> list[int]:
    """`(2, 3)` or `((2, 3),)` as `[2, 3]`."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = shape[0]
    return [int(s) for s in shape]

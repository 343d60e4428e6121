"""Shape and dtype of an operation's results, known on the client before anything runs.

The client runs the operation's own function (from `ops.py`, the one the worker will run) on
meta tensors: no data, no compute, PyTorch's exact shape rules and error messages. A training
loop repeats the same operations on the same shapes, so results are cached by the operation,
its inputs' shapes and dtypes, and its other arguments (for elementwise operations a scalar
operand counts only by its type: `x * lr` with a changing `lr` stays one cache entry).
"""

from __future__ import annotations

import torch

from paratrain.frontend.errors import FrontendError
from paratrain.frontend.ops import DTYPE_NAMES, OPS, TORCH_DTYPES

_CACHE: dict = {}
_CACHE_LIMIT = 1 << 16  # distinct (op, shapes) signatures; a program with more starts over


class ShapeError(FrontendError, ValueError):
    """The operation cannot run on inputs of these shapes/dtypes (raised where it was written)."""


def infer(name: str, args: list, targs: list, kwargs: dict) -> list[tuple[tuple, str]]:
    """[(shape, dtype name), ...] for each result of `name(*args, **kwargs)`; the tensors at
    positions `targs` are anything with a shape and a dtype (name)."""
    return infer_from(name, args, targs, [(args[i].shape, args[i].dtype) for i in targs], kwargs)


def infer_from(name: str, args: list, targs: list, tensors: list, kwargs: dict) -> list[tuple[tuple, str]]:
    """The same, each tensor argument given as (shape, dtype) in `tensors` (what is at its
    position in `args` is not looked at)."""
    op = OPS[name]
    key = (name, tuple(tensors), _signature(args, targs, op.elementwise), _hashable(kwargs) if kwargs else ())
    try:
        cached = _CACHE.get(key)
    except TypeError:  # an argument we cannot hash: infer without the cache
        key, cached = None, None
    if cached is not None:
        return cached
    results = _run_on_meta(name, op, args, targs, tensors, kwargs)
    if key is not None:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        _CACHE[key] = results
    return results


def warm_up() -> None:
    """PyTorch loads its Python meta kernels on the first elementwise meta op (about a second
    here); doing one now, while workers start, keeps that second off the program's first line."""
    with torch.no_grad():
        torch.empty(1, device="meta") + torch.empty(1, device="meta")


def _run_on_meta(name, op, args, targs, tensors, kwargs):
    meta_args = list(args)
    for i, (shape, dtype) in zip(targs, tensors):
        meta_args[i] = torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="meta")
    extra = {"device": "meta"} if op.kind == "create" else {}
    try:
        with torch.no_grad():
            result = op.fn(*meta_args, **kwargs, **extra)
    except Exception as error:  # noqa: BLE001 - re-raised with the operation and its inputs named
        shapes = ", ".join(f"{dtype}{list(shape)}" for shape, dtype in tensors)
        raise ShapeError(f"{name}({shapes}): {error}") from None
    if op.kind == "inplace":
        result = meta_args[0]
    results = result if isinstance(result, (tuple, list)) else (result,)
    return [(tuple(r.shape), DTYPE_NAMES[r.dtype]) for r in results]


def _signature(args, targs, elementwise: bool) -> tuple:
    """The other arguments, as a cache key (tensors are keyed by their shapes and dtypes)."""
    key = []
    for i, arg in enumerate(args):
        if i in targs:
            key.append(None)
        elif elementwise and isinstance(arg, (bool, int, float)):
            key.append(type(arg))
        else:
            key.append(_hashable(arg))
    return tuple(key)


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value

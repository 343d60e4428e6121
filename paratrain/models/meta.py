"""Models built on the meta device: their shapes, with neither memory nor initialisation time.

Validation, `--print-split`, FSDP's unit note and the MFU count build the model on the meta device
before any rank starts. A meta tensor has no values, yet `torch.nn.init` still runs on it:
`normal_` and `uniform_` go through PyTorch's Python decompositions, about 3 ms each, which made
building llama-tiny on meta take 40 ms and the own-model example 95 ms (most of validating a
layout). Under `on_meta()` those initialising in-place calls return their meta tensor unchanged:
in place, they cannot change a shape or a dtype, so the model comes out the same.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

# What torch.nn.init and the models' own init methods call on a parameter: normal_, uniform_,
# the steps of trunc_normal_ (uniform_, erfinv_, mul_, add_, clamp_), zeros and ones, copies.
_INITIALISERS = frozenset({
    "normal_", "uniform_", "zero_", "fill_", "erfinv_", "mul_", "add_", "clamp_", "copy_",
    "exponential_", "random_", "bernoulli_", "log_normal_", "cauchy_", "geometric_",
})


class _SkipInitialisingMeta(TorchFunctionMode):
    """Returns a meta tensor unchanged from an initialising in-place call; runs every other call.
    Torch-function modes are per thread, so a rank thread building real weights meanwhile is
    untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _INITIALISERS:
            target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by keyword
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextmanager
def on_meta():
    """Build modules inside this block on the meta device, skipping their weights' initialisation."""
    with torch.device("meta"), _SkipInitialisingMeta():
        yield


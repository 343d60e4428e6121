"""Gradient compression for the all-reduce: fp16/bf16 casts and top-k with error feedback.

Each compressor starts an averaging all-reduce of a flat gradient buffer and returns a
`Pending`; `Pending.finish()` waits and leaves the averaged (decompressed) gradient in the
buffer. Top-k keeps the largest `ratio` of the entries by magnitude; what it drops is added
back into the next step's gradient (error feedback), so nothing is lost, only delayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Pending:
    handles: list
    finish_fn: Callable[[], None] = lambda: None
    done: bool = False

    def wait(self) -> None:
        """Block until the average is in the buffer."""
        if not self.done:
            for handle in self.handles:
                handle.wait()
            self.finish_fn()
            self.done = True

    def finish(self, timer) -> None:
        """Like wait(), for an all-reduce that overlapped compute: only the wait is exposed."""
        if self.done:
            return
        with timer.waiting():
            for handle in self.handles:
                handle.wait()
        for handle in self.handles:
            timer.ran(handle.started, handle.finished)
        self.finish_fn()
        self.done = True


class NoCompression:
    name = "none"

    def start(self, group, flat: torch.Tensor, algo: str, key: int) -> Pending:
        return Pending([group.all_reduce(flat, "avg", algo, async_op=True)])


class CastCompression:
    """Send the gradient in half precision: half the bytes, about three decimal digits kept."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def start(self, group, flat, algo, key) -> Pending:
        low = flat.to(self.dtype)
        handle = group.all_reduce(low, "avg", algo, async_op=True)
        return Pending([handle], lambda: flat.copy_(low))


class TopKCompression:
    def __init__(self, ratio: float):
        self.ratio = ratio
        self.name = f"topk:{ratio:g}"
        self.residuals: dict[int, torch.Tensor] = {}  # per buffer: what top-k has not sent yet

    def start(self, group, flat, algo, key) -> Pending:
        residual = self.residuals.setdefault(key, torch.zeros_like(flat))
        corrected = flat + residual
        k = max(1, int(self.ratio * flat.numel()))
        indices = corrected.abs().topk(k, sorted=False).indices
        values = corrected[indices]
        residual.copy_(corrected)
        residual[indices] = 0  # what is sent now is no longer owed
        all_values = values.new_empty(k * group.size)
        all_indices = indices.new_empty(k * group.size)
        handles = [
            group.all_gather(all_values, values, algo, async_op=True),
            group.all_gather(all_indices, indices, algo, async_op=True),
        ]

        def densify():
            flat.zero_()
            flat.index_add_(0, all_indices, all_values)
            flat.div_(group.size)

        return Pending(handles, densify)


def build_compressor(spec: str):
    """'none', 'fp16', 'bf16' or 'topk:RATIO' (0 < RATIO <= 1)."""
    if spec in ("none", "", None):
        return NoCompression()
    if spec == "fp16":
        return CastCompression(torch.float16)
    if spec == "bf16":
        return CastCompression(torch.bfloat16)
    if spec.startswith("topk:"):
        ratio = float(spec.split(":", 1)[1])
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        return TopKCompression(ratio)
    raise ValueError(f"unknown compression {spec!r}; valid: none, fp16, bf16, topk:RATIO")

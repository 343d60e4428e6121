"""Reusable scratch buffers for collectives.

A fresh large tensor costs page faults on every call: here a 64 MiB clone takes ~25 ms where
copying into memory already touched takes ~3.5 ms. NCCL keeps its buffers for the same
reason. A pool belongs to one Group (or transport), which runs one collective at a time, so
a buffer is never used by two calls at once. `allocations` counts the buffers each pool made,
so a test can check that a steady state of calls makes none.
"""

from __future__ import annotations

import torch


class ScratchPool:
    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.allocations = 0  # buffers made so far: a steady state of calls makes none

    def get(self, slot, like: torch.Tensor, numel: int | None = None) -> torch.Tensor:
        """A flat tensor of `numel` (default: like's) elements of like's dtype and device,
        the same memory each time `slot` is asked for; its contents are undefined."""
        numel = like.numel() if numel is None else numel
        key = (slot, like.dtype, like.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[key] = buffer
            self.allocations += 1
        return buffer if buffer.numel() == numel else buffer[:numel]

    def copy_of(self, slot, tensor: torch.Tensor) -> torch.Tensor:
        """A flat scratch copy of `tensor` (instead of tensor.clone())."""
        return self.get(slot, tensor).copy_(tensor.reshape(-1))


class StagingPool:
    """Buffers that receives land in before they are reduced, taken for one message and given
    back once it is combined. Any number may be in flight (an algorithm posts the next step's
    receives while this step's are still arriving); a steady state of calls allocates none."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self.allocations = 0

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A buffer of like's shape, dtype and device; its contents are undefined."""
        free = self._free.get((like.numel(), like.dtype, like.device))
        if free:
            buffer = free.pop()
            return buffer if buffer.shape == like.shape else buffer.view(like.shape)
        self.allocations += 1
        return torch.empty(like.numel(), dtype=like.dtype, device=like.device).view(like.shape)

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((buffer.numel(), buffer.dtype, buffer.device), []).append(buffer)

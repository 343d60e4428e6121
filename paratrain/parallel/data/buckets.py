"""Gradient buckets: parameters grouped into flat buffers, in the order gradients appear.

Backward produces gradients roughly in reverse order of the parameters' registration, so
buckets are filled from the last parameter back. The first bucket is small, as in PyTorch's
DDP, so that its all-reduce can start almost as soon as backward does. Each parameter's
`.grad` is made a view into its bucket's buffer, so autograd accumulates straight into the
buffer that gets communicated: no copy in, no copy out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MIB = 1 << 20


@dataclass
class Bucket:
    index: int
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor  # flat, holds every param's gradient
    pending: set[int] = field(default_factory=set)  # ids of params whose grad is not ready yet

    def reset(self) -> None:
        self.pending = {id(p) for p in self.params}


def assign_buckets(params: list[torch.nn.Parameter], bucket_bytes: int, first_bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Group params (given in registration order) into buckets, last parameter first."""
    groups: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for param in reversed(params):
        cap = first_bucket_bytes if len(groups) == 1 else bucket_bytes
        nbytes = param.numel() * param.element_size()
        if groups[-1] and size + nbytes > cap:
            groups.append([])
            size = 0
        groups[-1].append(param)
        size += nbytes
    return [group for group in groups if group]


def build_buckets(params: list[torch.nn.Parameter], bucket_bytes: int, first_bucket_bytes: int) -> list[Bucket]:
    """Allocate one flat buffer per bucket and point each param's .grad into it."""
    buckets = []
    for index, group in enumerate(assign_buckets(params, bucket_bytes, first_bucket_bytes)):
        dtype, device = group[0].dtype, group[0].device
        buffer = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device)
        offset = 0
        for param in group:
            view = buffer[offset : offset + param.numel()].view_as(param)
            if param.grad is not None:
                view.copy_(param.grad)
            param.grad = view
            offset += param.numel()
        bucket = Bucket(index, group, buffer)
        bucket.reset()
        buckets.append(bucket)
    return buckets

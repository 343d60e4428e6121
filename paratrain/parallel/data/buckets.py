"""Gradient buckets: parameters grouped into flat buffers, in the order gradients appear.

Backward produces gradients roughly in reverse order of the parameters' registration, so
buckets are filled from the last parameter back. The first bucket is small, as in PyTorch's
DDP, so that its all-reduce can start almost as soon as backward does. Each parameter's
`.grad` is made a view into its bucket's buffer, so autograd accumulates straight into the
buffer that gets communicated: no copy in, no copy out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

MIB = 1 << 20


@dataclass
class Bucket:
    index: int
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor  # flat, holds every param's gradient


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
        buckets.append(Bucket(index, group, buffer))
    return buckets


class StartInOrder:
    """Starts each bucket's communication once backward has filled it, strictly in bucket
    order (0, 1, 2, ...), so that every rank issues the same collectives in the same order
    whatever order its hooks fire in. `start(k)` starts bucket k; `reset()` begins a step."""

    def __init__(self, buckets: list[list[torch.nn.Parameter]], start: Callable[[int], None]):
        self._bucket_of = {id(p): k for k, params in enumerate(buckets) for p in params}
        self._members = [{id(p) for p in params} for params in buckets]
        self._start = start
        self.reset()

    def reset(self) -> None:
        self.waiting = [set(members) for members in self._members]  # per bucket: grads not in yet
        self.started = 0  # buckets started so far this step

    def ready(self, param) -> None:
        """`param`'s gradient is complete for this step (parameters outside every bucket are ignored)."""
        k = self._bucket_of.get(id(param))
        if k is not None:
            self.waiting[k].discard(id(param))
            self.start_ready()

    def start_ready(self, everything: bool = False) -> None:
        """Start the filled buckets at the front of the order (with `everything`: all the rest,
        for parameters that got no gradient this step)."""
        while self.started < len(self.waiting):
            if self.waiting[self.started] and not everything:
                return
            self._start(self.started)
            self.started += 1


class ReductionsInOrder:
    """One step's gradient reductions, as every bucketed strategy runs them (DDP, ZeRO, FSDP):
    each bucket's starts, in bucket order, once backward has filled it (StartInOrder), and
    `finish` waits for them all. `start(k)` starts bucket k's and returns what finishes it
    (compression.Pending, or anything with its `finish(timer)`)."""

    def __init__(self, buckets: list[list[torch.nn.Parameter]], start: Callable[[int], object]):
        self._in_flight: list = []  # in the order started
        self._order = StartInOrder(buckets, lambda k: self._in_flight.append(start(k)))

    @property
    def started(self) -> int:
        """Buckets started so far this step."""
        return self._order.started

    def ready(self, param) -> None:
        """`param`'s gradient is complete for this step."""
        self._order.ready(param)

    def finish(self, timer) -> None:
        """Start what has not started and wait for everything; the next step begins afresh."""
        # Buckets with a parameter that got no gradient this step never started: they start now.
        self._order.start_ready(everything=True)
        for pending in self._in_flight:
            pending.finish(timer)
        self._in_flight = []
        self._order.reset()

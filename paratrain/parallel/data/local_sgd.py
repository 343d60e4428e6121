"""Local SGD: each rank steps on its own gradients; every K steps the parameters are averaged.

Communication drops K-fold; the price is that ranks drift apart between averages, so the
loss follows exact training only approximately.
"""

from __future__ import annotations

import torch

from paratrain.parallel.data.base import DataParallel


class LocalSGD(DataParallel):
    def __init__(self, module, group, algo="auto", every=4):
        super().__init__(module, group, algo)
        if every < 1:
            raise ValueError(f"local SGD period must be >= 1, got {every}")
        self.every = every
        self._steps = 0

    def after_step(self) -> None:
        self._steps += 1
        if self._steps % self.every == 0:
            self.average_parameters()

    def finish(self) -> None:
        if self._steps % self.every:
            self.average_parameters()  # end with one model, not world-size slightly different ones

    def average_parameters(self) -> None:
        params = [p.data for p in self.module.parameters()]
        flat = torch.cat([p.reshape(-1) for p in params])
        with self.timer.blocking():
            self.group.all_reduce(flat, "avg", self.algo)
        offset = 0
        for param in params:
            param.copy_(flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()

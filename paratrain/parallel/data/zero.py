"""ZeRO stage 1: optimizer state sharded across data-parallel ranks.

Gradients are reduce-scattered (each rank gets the average of its 1/n part), each rank
updates only its part of the parameters with its own optimizer state (1/n of Adam's moments),
and an all-gather puts the updated parts back together. The reduce-scatter plus all-gather
moves the same bytes as one all-reduce, and optimizer memory drops n-fold.

Parameters and gradients are views into two flat buffers, so the all-gather lands directly
in the model's parameters.
"""

from __future__ import annotations

import torch

from paratrain.comm.ops import part_bounds
from paratrain.parallel.data.base import DataParallel


class ZeroOneDataParallel(DataParallel):
    def __init__(self, module, group, algo="auto"):
        super().__init__(module, group, algo)
        self.params = [p for p in module.parameters() if p.requires_grad]
        count = sum(p.numel() for p in self.params)
        first = self.params[0]
        self.flat_params = torch.empty(count, dtype=first.dtype, device=first.device)
        self.flat_grads = torch.zeros_like(self.flat_params)
        offset = 0
        for param in self.params:
            end = offset + param.numel()
            self.flat_params[offset:end].copy_(param.data.view(-1))
            param.data = self.flat_params[offset:end].view_as(param)
            param.grad = self.flat_grads[offset:end].view_as(param)
            offset = end
        start, end = part_bounds(count, group.size)[group.rank]
        # The shard the optimizer sees: its own tensor, as optimizers keep state per tensor.
        self.shard = torch.nn.Parameter(self.flat_params[start:end].clone())
        self.shard.grad = torch.zeros_like(self.shard)

    def make_optimizer(self, build):
        return build([self.shard])

    def finish_gradients(self) -> None:
        with self.timer.blocking():
            self.group.reduce_scatter(self.shard.grad, self.flat_grads, "avg", self.algo)

    def step(self, optimizer) -> None:
        optimizer.step()
        with self.timer.blocking():
            self.group.all_gather(self.flat_params, self.shard.data, self.algo)

    def zero_grad(self) -> None:
        self.flat_grads.zero_()

"""FSDP's unit: the parameters one all-gather brings in, kept as a 1/n shard between uses.

A unit is a few modules run one after another in forward (a transformer block; a GPT's two
embeddings; its final norm and head). Its parameters are laid end to end in one flat buffer,
`full`, and each parameter becomes a view into it. Rank r keeps part r of that buffer
(`torch.tensor_split`'s parts, so sizes need not divide by the world) as its own tensor, the
`shard` the optimizer updates. Between uses `full`'s storage is freed (resized to nothing):
the views keep their shapes but hold no memory, and an all-gather into `full` brings every
view back to life at once, autograd's saved references to them included.

Gradients go the other way: once backward has written every parameter's gradient, they are
laid end to end and reduce-scattered (averaged) into `shard.grad`, then dropped.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.comm.ops import part_bounds
from paratrain.models import CNN, GPT, MLP, DeepMLP


def unit_modules(model: nn.Module) -> list[list[nn.Module]]:
    """The model's units in forward order, each a list of modules run one after the other."""
    if isinstance(model, GPT):
        return [[model.tok_emb, model.pos_emb], *[[block] for block in model.blocks], [model.ln_f, model.head]]
    if isinstance(model, CNN):
        return [*[[block] for block in model.blocks], [model.fc1], [model.fc2]]
    if isinstance(model, DeepMLP):
        return [[layer] for layer in model.layers]
    if isinstance(model, MLP):
        return [[model.fc1], [model.fc2]]
    # Any other model: each child that holds parameters, in registration order.
    return [[child] for child in model.children() if any(True for _ in child.parameters())]


class ShardedUnit:
    def __init__(self, index: int, modules: list[nn.Module], params: list[nn.Parameter], group, algo: str):
        self.index, self.modules, self.params, self.algo = index, modules, params, algo
        first = params[0]
        count = sum(p.numel() for p in params)
        self.full = torch.empty(count, dtype=first.dtype, device=first.device)
        offset = 0
        for param in params:
            end = offset + param.numel()
            self.full[offset:end].copy_(param.detach().reshape(-1))
            param.data = self.full[offset:end].view_as(param)
            offset = end
        self.own = slice(*part_bounds(count, group.size)[group.rank])  # this rank's part of `full`
        self.shard = nn.Parameter(self.full[self.own].clone())
        self.shard.grad = torch.zeros_like(self.shard)
        self._full_bytes = self.full.untyped_storage().nbytes()
        self.gathering = None  # the all-gather in flight, until waited on
        self.is_gathered = True
        self.in_backward = False  # its backward has begun (a recompute's forward must not free it)
        self.waiting: set[int] = set()  # ids of the parameters whose gradient this backward has not written
        self.free()

    def free(self) -> None:
        """Drop the gathered parameters (their views stay, holding nothing)."""
        self.full.untyped_storage().resize_(0)
        self.is_gathered, self.in_backward = False, False
        self.waiting = {id(p) for p in self.params}

    def start_gather(self, group) -> None:
        self.full.untyped_storage().resize_(self._full_bytes)
        self.gathering = group.all_gather(self.full, self.shard.detach(), self.algo, async_op=True)
        self.is_gathered = True

    def wait_gathered(self, timer) -> None:
        if self.gathering is not None:
            with timer.waiting():
                self.gathering.wait()
            timer.ran(self.gathering.started, self.gathering.finished)
            self.gathering = None

    def start_reduce_scatter(self, group):
        """Average every rank's gradients into `shard.grad`; the parameters' own are dropped.
        A parameter that got no gradient counts as zero."""
        flat = torch.cat([torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if p.grad is None
                          else p.grad.reshape(-1) for p in self.params])
        for param in self.params:
            param.grad = None
        return group.reduce_scatter(self.shard.grad, flat, "avg", self.algo, async_op=True)

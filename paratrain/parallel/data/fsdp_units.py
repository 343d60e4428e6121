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

Mixed precision (`compute_dtype` bf16): `full` is bf16, so the forward and backward compute
with bf16 parameters and produce bf16 gradients; the all-gather and the reduce-scatter move
bf16 (half the bytes), while the shard, its gradient and the optimizer state stay fp32: each
step updates the fp32 master weights, and the next gather rounds them to bf16 again.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from paratrain.comm.ops import part_bounds
from paratrain.parallel.data.compression import Pending
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
    def __init__(self, index: int, modules: list[nn.Module], params: list[nn.Parameter], group, algo: str,
                 compute_dtype: torch.dtype | None = None):
        self.index, self.modules, self.params, self.algo = index, modules, params, algo
        whole = torch.cat([p.detach().reshape(-1) for p in params])  # every rank starts from the same weights
        self.own = slice(*part_bounds(whole.numel(), group.size)[group.rank])  # this rank's part of `full`
        self.shard = nn.Parameter(whole[self.own].clone())
        self.shard.grad = torch.zeros_like(self.shard)
        self.full = torch.empty(whole.numel(), dtype=compute_dtype or whole.dtype, device=whole.device)
        self._point_params_into(self.full)
        self._full_bytes = self.full.untyped_storage().nbytes()
        self.gathering = None  # the all-gather in flight, until waited on
        self.is_gathered = True
        self.in_backward = False  # its backward has begun (a recompute's forward must not free it)
        self.waiting: set[int] = set()  # ids of the parameters whose gradient this backward has not written
        self.free()

    def _point_params_into(self, flat: torch.Tensor) -> None:
        offset = 0
        for param in self.params:
            end = offset + param.numel()
            param.data = flat[offset:end].view(param.shape)
            offset = end

    def free(self) -> None:
        """Drop the gathered parameters (their views stay, holding nothing)."""
        self.full.untyped_storage().resize_(0)
        self.is_gathered, self.in_backward = False, False
        self.waiting = {id(p) for p in self.params}

    def start_gather(self, group) -> None:
        self.full.untyped_storage().resize_(self._full_bytes)
        shard = self.shard.detach().to(self.full.dtype)  # a copy in bf16; kept by the call until it has run
        self.gathering = group.all_gather(self.full, shard, self.algo, async_op=True)
        self.is_gathered = True

    def wait_gathered(self, timer) -> None:
        if self.gathering is not None:
            with timer.waiting():
                self.gathering.wait()
            timer.ran(self.gathering.started, self.gathering.finished)
            self.gathering = None

    def start_reduce_scatter(self, group) -> Pending:
        """Average every rank's gradients into `shard.grad`; the parameters' own are dropped.
        A parameter that got no gradient counts as zero."""
        flat = torch.cat([torch.zeros(p.numel(), dtype=self.full.dtype, device=p.device) if p.grad is None
                          else p.grad.reshape(-1) for p in self.params])
        for param in self.params:
            param.grad = None
        if flat.dtype == self.shard.dtype:
            return Pending([group.reduce_scatter(self.shard.grad, flat, "avg", self.algo, async_op=True)])
        part = torch.empty(self.shard.numel(), dtype=flat.dtype, device=flat.device)
        handle = group.reduce_scatter(part, flat, "avg", self.algo, async_op=True)
        return Pending([handle], lambda: self.shard.grad.copy_(part))

    @contextmanager
    def whole(self, group):
        """The parameters whole in the shard's precision (fp32) inside the block, for reading or
        loading them; what the block leaves in them becomes this rank's shard. A collective."""
        master = torch.empty(self.full.numel(), dtype=self.shard.dtype, device=self.shard.device)
        group.all_gather(master, self.shard.detach(), self.algo)
        self._point_params_into(master)
        try:
            yield
        finally:
            self.shard.data.copy_(master[self.own])
            self.full.untyped_storage().resize_(self._full_bytes)  # views are cut from a live buffer
            self._point_params_into(self.full)
            self.is_gathered = True  # with nothing gathered: the caller frees it

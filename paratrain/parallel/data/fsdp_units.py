"""FSDP's unit: the parameters one all-gather brings in, kept as a 1/n shard between uses.

A unit is one block of the model's block list (a transformer block: what the plan's
pipeline.blocks names), or the root: what runs before and after the blocks (embeddings, final
norm, head) and any parameter two units share, as torchtitan calls fully_shard on each block and
then on the whole model. Its parameters are laid end to end in one flat buffer,
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
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.comm.ops import part_bounds
from paratrain.parallel.data.compression import Pending
from paratrain.parallel.plan import block_list


@dataclass
class UnitLayout:
    """Which parameters each unit holds: one unit per block of the model's block list, in forward
    order, and the root unit with everything else (what runs before and after the blocks, and any
    parameter two units share, such as tied embeddings: FSDP2's rule, a shared parameter belongs
    to its modules' common ancestor). `note` says why the model is one unit, when it is."""
    blocks: list[nn.Module]
    block_params: list[list[nn.Parameter]]
    root_params: list[nn.Parameter]
    note: str = ""


def unit_layout(model: nn.Module, plan=None) -> UnitLayout:
    """The units of `model`, read from `plan` (a Plan, or None) or from the model's structure
    (parallel/plan.py's block_list). Works on a model built on the meta device."""
    blocks = block_list(model, plan)
    if blocks is None:
        return UnitLayout([], [], list(model.parameters()),
                          f"fsdp: {type(model).__name__} names no list of blocks (no plan with pipeline.blocks, "
                          "no ModuleList of them), so it is one unit, gathered whole in each step: correct, "
                          "but its parameters are sharded only between steps")
    module_names = {id(module): name for name, module in model.named_modules()}
    prefixes = [module_names[id(block)] + "." for block in blocks]
    owners: dict[int, set] = {}  # parameter -> the units it is registered in (a block's index, or "root")
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = next((i for i, prefix in enumerate(prefixes) if name.startswith(prefix)), "root")
        owners.setdefault(id(param), set()).add(owner)
    shared = {key for key, found in owners.items() if len(found) > 1}
    block_params = [[p for p in block.parameters() if id(p) not in shared] for block in blocks]
    in_blocks = {id(p) for params in block_params for p in params}
    root = [p for p in model.parameters() if id(p) not in in_blocks]  # parameters() lists each once
    return UnitLayout(list(blocks), block_params, root)


class ShardedUnit:
    def __init__(self, index: int, modules: list[nn.Module], params: list[nn.Parameter], group, algo: str,
                 compute_dtype: torch.dtype | None = None, is_root: bool = False):
        """`modules`: those whose forward gathers the unit (a block; for the root, the modules
        the loop calls)."""
        self.index, self.modules, self.params, self.algo, self.is_root = index, modules, params, algo, is_root
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

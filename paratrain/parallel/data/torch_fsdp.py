"""PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`), the reference our FSDP is measured against.

Each block of our units (fsdp_units.unit_layout: the blocks of the plan's block list) is handed
to `fully_shard`, then the whole model (the root: embeddings, head, tied parameters), as
torchtitan does; a block holding a parameter shared with another unit is left to the root, as
FSDP2 requires; FSDP2 then gathers, frees and
reduce-scatters on its own, with its default prefetch of one unit. Its parameters become
DTensors sharded on their first dimension over a device mesh made from the data-parallel
group's process group, so it runs where that group has one: the processes launcher (gloo) or
torchrun. With bf16, its MixedPrecisionPolicy does what ours does: bf16 gathers, gradients and
reduce-scatters, fp32 shards.

FSDP2 waits for its reduce-scatters inside backward and gives no hook per collective, so the
communication split of a step is not measured here (reported as 0).
"""

from __future__ import annotations

from contextlib import contextmanager

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from paratrain.parallel.data.base import DataParallel
from paratrain.parallel.data.fsdp_units import unit_layout


class TorchFullyShardedDataParallel(DataParallel):
    def __init__(self, module, group, model=None, plan=None, reshard_after_forward=True, compute_dtype=None):
        super().__init__(module, group)
        process_group = group.transport.torch_process_group(group.timeout)
        options = {"mesh": DeviceMesh.from_group(process_group, group.transport.device.type),
                   "reshard_after_forward": reshard_after_forward,
                   "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype)}
        layout = unit_layout(model if model is not None else module, plan)
        for block, params in zip(layout.blocks, layout.block_params):
            if params and len(params) == len(list(block.parameters())):  # nothing in it is shared
                fully_shard(block, **options)
        fully_shard(module, **options)

    @contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            with super().no_sync():
                yield
        finally:
            self.module.set_requires_gradient_sync(True)

    grads_sharded = True  # DTensors sharded on their first dimension: each rank reads its own rows

    def gradient_pieces(self):
        return [(p, p.grad.to_local()) for p in self.module.parameters() if p.grad is not None]

    def zero_grad(self) -> None:
        for param in self.module.parameters():
            param.grad = None

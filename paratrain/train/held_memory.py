"""Memory a rank holds for its model, measured from its tensors: parameters, gradients and
optimizer state, at rest and at the peak of a step.

What is counted is storage, each storage once: a parameter that is a view into a flat buffer
(ZeRO-1/2's parameters, FSDP's gathered unit) counts that buffer; a freed FSDP buffer counts
nothing; a DTensor (PyTorch's FSDP2) counts its local shard. Parameters are the module's and
the optimizer's (ZeRO's shards are the optimizer's own tensors); gradients are theirs; the
optimizer's are the tensors in its state.

The peak is the largest total seen while one step runs, sampled as every module's forward
begins and ends and every gradient is written: the moments a unit is gathered or a gradient
bucket is complete. The temporary buffers of a collective in flight are not counted; the
activations are, apart, from the tensors autograd saves (saved_activations.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import sys

import torch

from paratrain.train.saved_activations import SavedActivations

KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor exists only where its module was imported (by whoever made one): checking
    # there spares every run that has none the half second that import costs.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor._local_tensor if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor


def _storage_bytes(tensors, seen: set) -> int:
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key[1] and key not in seen:
            seen.add(key)
            total += key[1]
    return total


class HeldMemory:
    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, opaque=()):
        """`opaque`: modules whose insides get no hooks, only the modules themselves (the layers
        --compile compiles: a hook inside would be traced, and its flag flipping for the watched
        step would recompile them)."""
        self.module, self.optimizer = module, optimizer
        self.peak_bytes = 0
        self.activations = SavedActivations(module)  # the watched step's, at their peak
        self._watching = False
        inside = {id(sub) for layer in opaque for sub in layer.modules() if sub is not layer}
        for submodule in module.modules():
            if id(submodule) in inside:
                continue
            submodule.register_forward_pre_hook(lambda *_: self._sample())
            submodule.register_forward_hook(lambda *_: self._sample())
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda _: self._sample())

    def measure(self) -> dict[str, int]:
        """{params_bytes, grads_bytes, optimizer_bytes} held now."""
        params = list(self.module.parameters()) + [p for g in self.optimizer.param_groups for p in g["params"]]
        seen: set = set()  # a storage counted under one heading is not counted again
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"params_bytes": _storage_bytes(params, seen),
                "grads_bytes": _storage_bytes([p.grad for p in params], seen),
                "optimizer_bytes": _storage_bytes(state, seen)}

    def _sample(self) -> None:
        if self._watching:
            self.peak_bytes = max(self.peak_bytes, sum(self.measure().values()))

    @contextmanager
    def watching(self):
        """Inside: every hook samples; `peak_bytes` is the largest total seen (from the entry's)."""
        self.peak_bytes = sum(self.measure().values())
        self._watching = True
        try:
            with self.activations:
                yield
        finally:
            self._sample()
            self._watching = False


def per_rank(values: dict[str, int], group) -> dict[str, list[int]]:
    """Every rank's values, by key, in rank order (a collective over `group`)."""
    mine = torch.tensor([values[key] for key in values], dtype=torch.float64)
    everyone = torch.empty(len(values) * group.size, dtype=torch.float64)
    group.all_gather(everyone, mine)
    table = everyone.view(group.size, len(values)).long().tolist()
    return {key: [row[i] for row in table] for i, key in enumerate(values)}

"""What a worker runs for sharded operations: paratrain's tensor-parallel autograd functions
over a process group of the workers that share a tensor (made once, on the dispatcher's word).

Every op here is named by the dispatcher only (see sharding.py for when it asks for which):

    make_group         a Group of exactly these workers (they all make it, in the same order)
    tp_f / tp_g        Megatron's f (identity, all-reduce in backward) and g (all-reduce)
    tp_scatter         replicated -> my part of an axis (backward gathers)
    tp_gather          parts -> the whole tensor on every worker (backward keeps my part)
    tp_broadcast       a replicated random tensor: drawn on the first worker, sent to the rest
    vp_embedding       a lookup in a table split by rows (vocab-parallel)
    vp_cross_entropy   cross-entropy of logits split on the vocabulary, never gathered
    alias              another handle for the same tensor (gt.signal.tensor's result)
"""

from __future__ import annotations

import torch

from paratrain.comm import Group
from paratrain.comm.ops import part_bounds
from paratrain.frontend.ops import torch_dtype
from paratrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from paratrain.parallel.tensor.layers import vocab_parallel_embedding
from paratrain.parallel.tensor.tp_comms import (
    copy_to_parallel, gather_from_parallel, reduce_from_parallel, split_to_parallel,
)


class CollectiveOps:
    """Mixed into Executor: `self.group` is the workers' world, `self.groups` its subgroups."""

    def _subgroup(self, kwargs) -> Group:
        return self.groups[tuple(kwargs["g"])]

    def _op_make_group(self, base, outs, args, kwargs, flags, frames):
        members = list(kwargs["g"])
        self.groups[tuple(members)] = Group(self.group.transport.split(members), timeout=self.group.timeout)

    def _op_tp_f(self, base, outs, args, kwargs, flags, frames):
        x = args[0]
        tracked = x.requires_grad and torch.is_grad_enabled()
        self.tensors[base + outs[0]] = copy_to_parallel(x, self._subgroup(kwargs)) if tracked else x

    def _op_tp_g(self, base, outs, args, kwargs, flags, frames):
        self.tensors[base + outs[0]] = reduce_from_parallel(args[0], self._subgroup(kwargs))

    def _op_tp_scatter(self, base, outs, args, kwargs, flags, frames):
        self.tensors[base + outs[0]] = split_to_parallel(args[0], self._subgroup(kwargs), kwargs["axis"])

    def _op_tp_gather(self, base, outs, args, kwargs, flags, frames):
        group = self._subgroup(kwargs)
        self.tensors[base + outs[0]] = gather_from_parallel(args[0], group, kwargs["axis"], kwargs["length"])

    def _op_tp_broadcast(self, base, outs, args, kwargs, flags, frames):
        group, key = self._subgroup(kwargs), base + outs[0]
        if group.rank == 0:
            tensor = self.tensors[key].detach()
        else:
            tensor = torch.empty(kwargs["shape"], dtype=torch_dtype(kwargs["dtype"]), device=self.device)
        group.broadcast(tensor, root=0)
        if flags and flags.get("rg"):
            tensor.requires_grad_(True)
        self.tensors[key] = tensor

    def _op_vp_embedding(self, base, outs, args, kwargs, flags, frames):
        group = self._subgroup(kwargs)
        start, _ = part_bounds(kwargs["vocab"], group.size)[group.rank]
        self.tensors[base + outs[0]] = vocab_parallel_embedding(args[0], args[1], group, start)

    def _op_vp_cross_entropy(self, base, outs, args, kwargs, flags, frames):
        group = self._subgroup(kwargs)
        self.tensors[base + outs[0]] = vocab_parallel_cross_entropy(args[0], args[1], group, kwargs["vocab"])

    def _op_alias(self, base, outs, args, kwargs, flags, frames):
        self.tensors[base + outs[0]] = args[0]

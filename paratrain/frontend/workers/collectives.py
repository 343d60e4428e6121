"""What a worker runs for sharded operations: paratrain's tensor-parallel autograd functions
over a process group of the workers that share a tensor (made once, on the dispatcher's word).

Every op here is named by the dispatcher only (see sharding_rules.py for when it asks for which):

    make_group         a Group of exactly these workers (every worker takes part, in one order)
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


def _group(executor, step) -> Group:
    return executor.groups[tuple(step.instruction.kwargs["g"])]


def make_group(executor, step) -> None:
    """Every worker runs this, members or not, in the dispatcher's order (see ensure_group)."""
    members = list(step.instruction.kwargs["g"])
    group = executor.group
    made = group.transport.split_with_everyone(members)
    if made is not None:
        executor.groups[tuple(members)] = Group(made, timeout=group.timeout)


def tp_f(executor, step) -> None:
    x = step.args[0]
    tracked = x.requires_grad and torch.is_grad_enabled()
    executor.store(step, copy_to_parallel(x, _group(executor, step)) if tracked else x)


def tp_g(executor, step) -> None:
    executor.store(step, reduce_from_parallel(step.args[0], _group(executor, step)))


def tp_scatter(executor, step) -> None:
    executor.store(step, split_to_parallel(step.args[0], _group(executor, step), step.instruction.kwargs["axis"]))


def tp_gather(executor, step) -> None:
    kwargs = step.instruction.kwargs
    executor.store(step, gather_from_parallel(step.args[0], _group(executor, step), kwargs["axis"], kwargs["length"]))


def tp_broadcast(executor, step) -> None:
    group, key, kwargs = _group(executor, step), step.base + step.instruction.outs[0], step.instruction.kwargs
    if group.rank == 0:
        tensor = executor.tensors[key].detach()
    else:
        tensor = torch.empty(kwargs["shape"], dtype=torch_dtype(kwargs["dtype"]), device=executor.device)
    group.broadcast(tensor, root=0)
    if step.instruction.requires_grad:
        tensor.requires_grad_(True)
    executor.tensors[key] = tensor


def vp_embedding(executor, step) -> None:
    group = _group(executor, step)
    start, _ = part_bounds(step.instruction.kwargs["vocab"], group.size)[group.rank]
    executor.store(step, vocab_parallel_embedding(step.args[0], step.args[1], group, start))


def vp_cross_entropy(executor, step) -> None:
    group = _group(executor, step)
    executor.store(step, vocab_parallel_cross_entropy(step.args[0], step.args[1], group, step.instruction.kwargs["vocab"]))


def alias(executor, step) -> None:
    executor.store(step, step.args[0])


HANDLERS = {
    "make_group": make_group, "tp_f": tp_f, "tp_g": tp_g, "tp_scatter": tp_scatter, "tp_gather": tp_gather,
    "tp_broadcast": tp_broadcast, "vp_embedding": vp_embedding, "vp_cross_entropy": vp_cross_entropy, "alias": alias,
}

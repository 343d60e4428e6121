"""Gradient clipping by the global norm, over every shard of every layout.

On one process, `torch.nn.utils.clip_grad_norm_(params, max_norm)` takes the 2-norm of all the
gradients as one vector and, when it exceeds `max_norm`, scales every gradient by
max_norm / (norm + 1e-6). In a parallel run that vector is spread over the mesh, and the
frameworks that get clipping wrong get it wrong by counting an element twice or not at all. Here
each element of the single-process vector is counted exactly once:

- data parallelism: ddp, naive, local SGD and PyTorch's DDP hold the same whole (averaged)
  gradient on every replica, counted once (no sum over dp); ZeRO-1/2 and FSDP hold 1/n of it,
  the shard their optimizer reads, summed over dp (dp x cp under context parallelism, whose
  ranks hold the same parameters);
- tensor parallelism: a split layer's gradient is split too (summed over tp); a replicated
  parameter (the norms, a row-parallel layer's bias) has the same gradient on every tp rank
  (sequence parallelism all-reduces the ones that see only a rank's tokens) and is counted on
  tp rank 0 alone;
- pipeline parallelism: each stage holds its own layers (summed over pp; tied parameters
  across stages are refused before any rank starts);
- expert parallelism: each rank of an ep group holds other experts, whole and already reduced
  over the ranks holding the same ones (summed over ep, whatever the strategy does with the rest).

The squares are summed in fp32 and reduced over dp (when sharded), tp and pp, in that order, so
every rank gets the same norm and scales what its optimizer reads by the same factor.
"""

from __future__ import annotations

import torch
from torch import nn

# torch.nn.utils.clip_grad_norm_'s guard against dividing by zero, so that the factors match.
EPSILON = 1e-6


def split_parameter_ids(module: nn.Module) -> set[int]:
    """The parameters tensor parallelism splits (the layers' `shard_layout`); the rest of a
    tensor-parallel model is replicated."""
    return {id(getattr(m, name)) for m in module.modules() for name in getattr(m, "shard_layout", {})}


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters expert parallelism spreads over its ranks (marked `expert_parallel`)."""
    return [p for p in module.parameters() if getattr(p, "expert_parallel", False)]


def _square_sum(pieces, tp, split: set[int], device) -> torch.Tensor:
    square_sum = torch.zeros(1, dtype=torch.float32, device=device)
    for param, grad in pieces:
        if tp.size > 1 and tp.rank != 0 and id(param) not in split:
            continue  # replicated over tp: tp rank 0 counts it
        square_sum += grad.detach().float().pow(2).sum()
    return square_sum


@torch.no_grad()
def global_grad_norm(dp, mesh) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, the same on every rank (a collective over the
    mesh: every rank calls it at the same point, after `dp.finish_gradients()`)."""
    experts = expert_parameters(dp.module)
    expert_ids = {id(p) for p in experts}
    pieces = [(p, g) for p, g in dp.gradient_pieces() if id(p) not in expert_ids]
    tp = mesh.tp
    split = split_parameter_ids(dp.module) if tp.size > 1 else set()
    square_sum = _square_sum(pieces, tp, split, dp.device)
    if dp.grads_sharded and mesh.dp_cp.size > 1:  # sharded over every rank holding these parameters
        mesh.dp_cp.all_reduce(square_sum, "sum")
    if experts:
        expert_sum = _square_sum([(p, p.grad) for p in experts if p.grad is not None], tp, split, dp.device)
        if getattr(mesh, "ep", None) is not None:
            mesh.ep.all_reduce(expert_sum, "sum")
        square_sum += expert_sum
    for group in (tp, mesh.pp):
        if group.size > 1:
            group.all_reduce(square_sum, "sum")
    return square_sum.sqrt()


@torch.no_grad()
def clip_grad_norm_(dp, mesh, max_norm: float) -> float:
    """Scale the gradients the optimizer is about to read so that their global norm is at most
    `max_norm`, as torch.nn.utils.clip_grad_norm_ does on one process; returns the norm before
    clipping."""
    norm = global_grad_norm(dp, mesh)
    # Computed in fp32 as torch's is; a Python number multiplies PyTorch FSDP2's DTensors too.
    factor = torch.clamp(max_norm / (norm + EPSILON), max=1.0).item()
    grads = dp.gradients_to_scale()
    scaled = {id(g) for g in grads}
    grads += [p.grad for p in expert_parameters(dp.module) if p.grad is not None and id(p.grad) not in scaled]
    for grad in grads:
        grad.mul_(factor)
    return norm.item()


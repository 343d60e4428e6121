"""The communication of tensor parallelism: autograd functions whose backward is the
conjugate of their forward, over the tensor-parallel Group.

Megatron's pair for activations that are replicated on every tp rank:

    copy_to_parallel      forward: identity      backward: all-reduce   (Megatron's f)
    reduce_from_parallel  forward: all-reduce    backward: identity     (Megatron's g)

and, for sequence parallelism (activations sharded along the sequence between blocks):

    scatter_sequence         forward: keep my part      backward: all-gather
    gather_sequence          forward: all-gather        backward: reduce-scatter
    reduce_scatter_sequence  forward: reduce-scatter    backward: all-gather

With one rank every function returns its input untouched: no communication, and no extra
node in the autograd graph. All collectives are blocking calls on the rank's own thread, in
the order autograd visits the graph, which is the same on every rank of the group.

Rank r always holds part r of a split dimension, the layout the Group's all_gather and
reduce_scatter use. Sequence parts are equal (the length must divide by tp); the vocabulary's
may differ by one (part_sizes' rule), which all_gather_along handles when told the length.
"""

from __future__ import annotations

import torch

from paratrain.comm.ops import part_sizes

# Sequence parallelism splits activations laid out (B, T, D) along T.
SEQUENCE_DIM = 1


def _check_divisible(what: str, tensor: torch.Tensor, dim: int, size: int) -> None:
    if tensor.shape[dim] % size:
        raise ValueError(
            f"{what}: dimension {dim} of a tensor of shape {tuple(tensor.shape)} "
            f"must be divisible by the tensor-parallel size {size}"
        )


# ---- plain collectives along a dimension (no autograd) -------------------------------------


def all_reduce_copy(tensor: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """A new tensor holding the all-reduce of `tensor` (the input is left as it was)."""
    result = tensor.clone(memory_format=torch.contiguous_format)
    group.all_reduce(result, op=op)
    return result


def all_gather_along(
    tensor: torch.Tensor, group, dim: int, parts: int = 1, length: int | None = None
) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim`, rank 0's first.

    length: the gathered length of `dim`, when the ranks' parts may differ in size (the
    vocabulary, split by part_sizes' rule: rank r holds part_sizes(length, tp)[r]). Left out,
    every rank's part is taken to be as long as this one's.

    parts > 1 undoes `layers.shard(..., parts)`: `dim` is `parts` blocks side by side (a fused
    qkv's [q | k | v]) and each rank holds its slice of every block, so the blocks are
    reassembled one by one. Such blocks are always split evenly.
    """
    if group.size == 1:
        return tensor
    dim = dim % tensor.dim()
    shape = list(tensor.shape)
    if length is not None and length != group.size * shape[dim]:
        if parts != 1:
            raise ValueError(f"all_gather_along: fused blocks ({parts}) are split evenly, never unevenly")
        return _all_gather_uneven(tensor, group, dim, length)
    stacked = tensor.new_empty(group.size, *shape)  # stacked[r] is rank r's tensor
    group.all_gather(stacked, tensor.contiguous())
    block = shape[dim] // parts
    # [S, *pre, parts, block, *post] -> [*pre, parts, S, block, *post] -> merged
    stacked = stacked.view(group.size, *shape[:dim], parts, block, *shape[dim + 1 :])
    stacked = stacked.movedim(0, dim + 1)
    return stacked.reshape(*shape[:dim], group.size * shape[dim], *shape[dim + 1 :])


def _all_gather_uneven(tensor: torch.Tensor, group, dim: int, length: int) -> torch.Tensor:
    """all_gather_along for parts of part_sizes(length, tp). Each rank pads its part to the
    longest (rank 0's) and the padded parts travel as one even all-gather: the Group's own
    uneven rule splits the flat numel, which cuts rows of a 2-D part in the wrong places."""
    sizes = part_sizes(length, group.size)
    if tensor.shape[dim] != sizes[group.rank]:
        raise ValueError(
            f"all_gather_along: rank {group.rank} holds {tensor.shape[dim]} of dimension {dim}, "
            f"but part {group.rank} of {length} over {group.size} ranks is {sizes[group.rank]}"
        )
    front = tensor.movedim(dim, 0)
    padded = front.new_zeros(sizes[0], *front.shape[1:])
    padded[: sizes[group.rank]] = front
    stacked = padded.new_empty(group.size, *padded.shape)  # stacked[r] is rank r's, padded
    group.all_gather(stacked, padded)
    full = torch.cat([stacked[r, :size] for r, size in enumerate(sizes)])
    return full.movedim(0, dim)


def reduce_scatter_along(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum `tensor` over the ranks; rank r keeps part r of `dim`."""
    if group.size == 1:
        return tensor
    _check_divisible("reduce_scatter_along", tensor, dim, group.size)
    front = tensor.movedim(dim, 0).contiguous()  # parts of dim 0 are contiguous blocks
    mine = front.new_empty(front.shape[0] // group.size, *front.shape[1:])
    group.reduce_scatter(mine, front)
    return mine.movedim(0, dim)


def split_along(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's part of `dim` (no communication)."""
    if group.size == 1:
        return tensor
    _check_divisible("split_along", tensor, dim, group.size)
    return tensor.chunk(group.size, dim=dim)[group.rank].contiguous()


# ---- Megatron's f and g ----------------------------------------------------------------


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_copy(grad, ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: each rank's gradient with
    respect to `x` is partial (it saw only its shard of the weights), so backward sums them."""
    return x if group.size == 1 else _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a tensor-parallel region: sum the ranks' partial outputs. The sum's gradient
    is the same on every rank, so backward passes it through."""
    return x if group.size == 1 else _ReduceFromParallel.apply(x, group)


# ---- a replicated tensor and its parts, along any dimension ------------------------------


class _SplitToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.length = group, dim, x.shape[dim]
        return torch.tensor_split(x, group.size, dim=dim)[group.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad.contiguous(), ctx.group, ctx.dim, length=ctx.length), None, None


class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, length):
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x.contiguous(), group, dim, length=length)

    @staticmethod
    def backward(ctx, grad):
        return torch.tensor_split(grad, ctx.group.size, dim=ctx.dim)[ctx.group.rank].contiguous(), None, None, None


def split_to_parallel(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Replicated -> this rank's part of `dim` (part_sizes' parts, so any length splits).
    Every rank's gradient of its part is whole, so backward gathers them."""
    return x if group.size == 1 else _SplitToParallel.apply(x, group, dim)


def gather_from_parallel(x: torch.Tensor, group, dim: int, length: int) -> torch.Tensor:
    """Parts of `dim` (`length` long in all) -> the whole tensor on every rank (Megatron's
    gather). Downstream work is replicated, so each rank's gradient is whole: backward keeps
    this rank's part. (gather_sequence reduce-scatters instead: there the gradient is partial.)"""
    return x if group.size == 1 else _GatherFromParallel.apply(x, group, dim, length)


# ---- sequence parallelism --------------------------------------------------------------


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.group, ctx.dim), None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.group, ctx.dim), None, None


def scatter_sequence(x: torch.Tensor, group, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Replicated -> sequence-sharded: keep this rank's part. Backward gathers the parts, so
    whatever produced `x` gets its whole gradient on every rank."""
    return x if group.size == 1 else _ScatterSequence.apply(x, group, dim)


def gather_sequence(x: torch.Tensor, group, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Sequence-sharded -> replicated, entering a tensor-parallel region. Each rank's gradient
    of the full sequence is partial, so backward reduce-scatters it: the sum, and only my part
    of it, in one collective (this replaces copy_to_parallel's all-reduce)."""
    return x if group.size == 1 else _GatherSequence.apply(x, group, dim)


def reduce_scatter_sequence(x: torch.Tensor, group, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Partial sums -> sequence-sharded sum, leaving a tensor-parallel region (this replaces
    reduce_from_parallel's all-reduce: half the bytes). Backward gathers the gradient's parts."""
    return x if group.size == 1 else _ReduceScatterSequence.apply(x, group, dim)

"""Tensor-parallel layers, each built from an existing single-device layer by slicing its
weights for this tp rank, so a sharded model starts from exactly the unsharded weights.

    ColumnParallelLinear   y_BTO[:, :, mine] = x_BTI @ W[mine, :].T + b[mine]   (output split)
    RowParallelLinear      y_BTO = sum over ranks of x_BTI[:, :, mine] @ W[:, mine].T, + b
    VocabParallelEmbedding each rank looks up its contiguous vocabulary range; the sum over
                           ranks is the lookup (an id belongs to exactly one range)
    SequenceShardedEmbedding  a replicated table whose output each rank keeps its sequence
                           part of (the position table under sequence parallelism)

A column-parallel layer followed by a row-parallel one (attention's qkv -> proj, the MLP's
up -> down) needs one all-reduce forward and one backward, as in Megatron-LM.

A plain split (`shard` with parts=1) follows part_sizes' rule, as every collective does: when
the length does not divide by tp, the first length % tp ranks hold one more. That is what lets
an odd vocabulary (GPT-2's 50257) be split. The hidden dimensions could split the same way,
but parallelize_gpt keeps them even (tp_problems): attention heads must stay whole.

Each layer records in `shard_layout` which of its parameters are split, as (dim, fused
blocks, unsplit length of dim), so `parallelize.gather_full_state` can reassemble the
single-device weights; the parameters keep the names of the layer they replace.

Shape legend: B batch, T sequence, I in features, O out features, V vocabulary, D width;
a `_shard` suffix marks this rank's part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.comm.ops import part_bounds
from paratrain.parallel.tensor.tp_comms import (
    copy_to_parallel,
    reduce_from_parallel,
    reduce_scatter_sequence,
    scatter_sequence,
)


def shard(tensor: torch.Tensor, dim: int, rank: int, size: int, parts: int = 1) -> torch.Tensor:
    """Rank's contiguous part of `dim`, as a copy: part_bounds(length, size)[rank].

    parts > 1 is the head-aware split of a fused projection: `dim` holds `parts` blocks side
    by side (qkv's output is [q | k | v], heads contiguous within each), and the rank takes
    its slice of every block. Rank r thus gets the q, k and v of the same heads, and its
    output is again [q | k | v], only narrower, which the attention code splits unchanged.
    """
    length = tensor.shape[dim]
    if parts == 1:
        start, end = part_bounds(length, size)[rank]
        return tensor.narrow(dim, start, end - start).clone()
    if length % (parts * size):
        raise ValueError(
            f"cannot shard dimension {dim} of size {length} into {parts} block(s) x {size} ranks"
        )
    blocks = tensor.unflatten(dim, (parts, length // parts))  # [..., parts, block, ...]
    mine = blocks.chunk(size, dim=dim + 1)[rank]
    return mine.flatten(dim, dim + 1).clone()


def linear_shape(module: nn.Module) -> tuple[int, int, bool] | None:
    """(in features, out features, weight stored (in, out)) of a linear layer: an nn.Linear keeps
    its weight (out, in); transformers' Conv1D (GPT-2's projections: `nf` out, `nx` in, y = x W + b)
    keeps it (in, out). None for anything else. The parallel layers keep the orientation they
    were given, so a parameter keeps its name, shape and layout in every checkpoint."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    weight = getattr(module, "weight", None)
    if isinstance(getattr(module, "nf", None), int) and isinstance(getattr(module, "nx", None), int) \
            and isinstance(weight, torch.Tensor) and tuple(weight.shape) == (module.nx, module.nf):
        return module.nx, module.nf, True
    return None


def _parameter_like(source: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(value, requires_grad=source.requires_grad)


class ColumnParallelLinear(nn.Module):
    """The output features split over the tp ranks; the input is replicated.

    sequence_parallel=False: the input is replicated on entry, and backward all-reduces its
    partial gradients (copy_to_parallel). sequence_parallel=True: the caller has all-gathered
    the input from sequence shards (tp_comms.gather_sequence, at the module boundary), and
    that gather's reduce-scatter already sums the gradients, so this layer must not.
    """

    def __init__(self, linear: nn.Module, group, *, fused_parts: int = 1, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel, self.fused_parts = group, sequence_parallel, fused_parts
        self.in_features, self.full_out_features, self.transposed = linear_shape(linear)
        out_dim = 1 if self.transposed else 0
        split = dict(rank=group.rank, size=group.size, parts=fused_parts)
        self.weight = _parameter_like(linear.weight, shard(linear.weight.detach(), dim=out_dim, **split))
        self.out_features = self.weight.shape[out_dim]  # this rank's
        self.bias = None
        self.shard_layout = {"weight": (out_dim, fused_parts, self.full_out_features)}
        if linear.bias is not None:
            self.bias = _parameter_like(linear.bias, shard(linear.bias.detach(), dim=0, **split))
            self.shard_layout["bias"] = (0, fused_parts, self.full_out_features)

    def forward(self, x_BTI: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            x_BTI = copy_to_parallel(x_BTI, self.group)
        return F.linear(x_BTI, self.weight.t() if self.transposed else self.weight, self.bias)  # y_BTO_shard

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(of {self.full_out_features}), fused_parts={self.fused_parts}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """The input features split over the tp ranks (the input arrives sharded on its last
    dimension, as a column-parallel layer leaves it); the output is the sum over ranks.

    The bias is replicated and added once, after the sum. sequence_parallel=True
    reduce-scatters the sum along the sequence instead of all-reducing it; each rank's bias
    gradient then covers only its tokens and must be all-reduced over tp (parallelize_gpt
    registers a hook for that).
    """

    def __init__(self, linear: nn.Module, group, *, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.full_in_features, self.out_features, self.transposed = linear_shape(linear)
        in_dim = 0 if self.transposed else 1
        self.weight = _parameter_like(
            linear.weight, shard(linear.weight.detach(), dim=in_dim, rank=group.rank, size=group.size)
        )
        self.in_features = self.weight.shape[in_dim]  # this rank's
        self.bias = None if linear.bias is None else _parameter_like(linear.bias, linear.bias.detach().clone())
        self.shard_layout = {"weight": (in_dim, 1, self.full_in_features)}

    def forward(self, x_BTI_shard: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        if self.group.size == 1:
            return F.linear(x_BTI_shard, weight, self.bias)  # exactly the plain layer
        partial_BTO = F.linear(x_BTI_shard, weight)
        if self.sequence_parallel:
            y_BTO = reduce_scatter_sequence(partial_BTO, self.group)  # y_B(T/tp)O
        else:
            y_BTO = reduce_from_parallel(partial_BTO, self.group)
        return y_BTO if self.bias is None else y_BTO + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (of {self.full_in_features}), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


def _check_plain_embedding(embedding: nn.Embedding, kind: str) -> None:
    if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
        raise ValueError(f"{kind} supports plain embeddings only (no padding_idx, max_norm or sparse gradients)")


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows part_bounds(V, tp)[r] of the table (V/tp each when tp divides V,
    else the first V % tp ranks one more, as the head's logits). Ids outside that range
    look up zeros here; the sum over ranks (all-reduce, or with sequence_parallel a
    reduce-scatter along the sequence) is the full lookup. Each rank's weight gradient lands
    on its own rows only, from every token, since backward passes the whole output gradient
    to every rank."""

    def __init__(self, embedding: nn.Embedding, group, *, sequence_parallel: bool = False):
        super().__init__()
        _check_plain_embedding(embedding, "VocabParallelEmbedding")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_size, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.vocab_start, vocab_end = part_bounds(self.vocab_size, group.size)[group.rank]
        self.num_embeddings = vocab_end - self.vocab_start  # this rank's
        self.weight = _parameter_like(
            embedding.weight, shard(embedding.weight.detach(), dim=0, rank=group.rank, size=group.size)
        )
        self.shard_layout = {"weight": (0, 1, self.vocab_size)}

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(idx_BT, self.weight, self.group, self.vocab_start, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (
            f"vocab [{self.vocab_start}, {self.vocab_start + self.num_embeddings}) "
            f"of {self.vocab_size}, embedding_dim={self.embedding_dim}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


def vocab_parallel_embedding(idx_BT: torch.Tensor, weight_shard: torch.Tensor, group, vocab_start: int,
                             sequence_parallel: bool = False) -> torch.Tensor:
    """The lookup of ids in a table whose rows [vocab_start, vocab_start + len) this rank holds:
    zeros for ids outside it, then the sum over ranks (each id is in exactly one range)."""
    if group.size == 1:
        return F.embedding(idx_BT, weight_shard)
    local_BT = idx_BT - vocab_start
    outside_BT = (local_BT < 0) | (local_BT >= weight_shard.shape[0])
    partial_BTD = F.embedding(local_BT.masked_fill(outside_BT, 0), weight_shard)
    partial_BTD = partial_BTD.masked_fill(outside_BT.unsqueeze(-1), 0.0)
    if sequence_parallel:
        return reduce_scatter_sequence(partial_BTD, group)  # x_B(T/tp)D
    return reduce_from_parallel(partial_BTD, group)


class SequenceShardedEmbedding(nn.Module):
    """A replicated table (every rank holds all of it) whose output, shaped (..., T, D), each
    rank keeps only its part of T: the position table under sequence parallelism, where the
    token embeddings it is added to arrive sharded along the sequence. Backward gathers the
    parts of the gradient, so the table's gradient is whole and the same on every rank."""

    def __init__(self, embedding: nn.Embedding, group):
        super().__init__()
        _check_plain_embedding(embedding, "SequenceShardedEmbedding")
        self.group = group
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.weight = _parameter_like(embedding.weight, embedding.weight.detach().clone())

    def forward(self, idx_T: torch.Tensor) -> torch.Tensor:
        return scatter_sequence(F.embedding(idx_T, self.weight), self.group, dim=-2)  # (T/tp)D

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, output sharded along the sequence"

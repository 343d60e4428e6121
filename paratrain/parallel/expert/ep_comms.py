"""The communication of expert parallelism: an autograd all-to-all of rows in uneven parts.

A mixture-of-experts layer sends each token (a row) to the rank holding its expert: rank r
sends input_splits[j] rows to rank j and receives output_splits[i] rows from rank i, counts
its router decided and that differ from step to step and from rank to rank. The gradient of a
row goes back the way the row came, so the backward of this dispatch is the all-to-all with
the splits swapped (the combine), and the combine's backward is a dispatch again.

Rows are dimension 0; the rows for rank j (from rank i) lie together, in rank order, as
torch.distributed's all_to_all_single lays them out. With one rank the input is returned
untouched: no communication, and no extra node in the autograd graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def exchange_rows(x_RD: torch.Tensor, group, output_splits: Sequence[int], input_splits: Sequence[int]) -> torch.Tensor:
    """A new tensor of the rows every rank sends this one (no autograd)."""
    out_RD = x_RD.new_empty(sum(output_splits), *x_RD.shape[1:])
    group.all_to_all(out_RD, x_RD.contiguous(), output_split_sizes=list(output_splits),
                     input_split_sizes=list(input_splits))
    return out_RD


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return exchange_rows(x_RD, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad_RD):
        # the rows' gradients travel back: what was received is sent, what was sent is received
        return exchange_rows(grad_RD, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def all_to_all_rows(x_RD: torch.Tensor, group, output_splits: Sequence[int],
                    input_splits: Sequence[int]) -> torch.Tensor:
    """Send input_splits[j] rows of `x_RD` (in order, rank 0's first) to rank j; return the
    output_splits[i] rows from each rank i, rank 0's first. Differentiable: backward sends each
    row's gradient back to the rank that sent the row."""
    if group.size == 1:
        return x_RD
    return _AllToAllRows.apply(x_RD, group, tuple(output_splits), tuple(input_splits))

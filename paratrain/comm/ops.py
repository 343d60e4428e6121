"""Reduction operators and the rule that splits a buffer into per-rank parts.

Every algorithm and transport shares these two things, so that a ring reduce-scatter on
threads and gloo's own collective agree on which rank owns which elements.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

REDUCE_OPS = ("sum", "avg", "max", "min")


def check_reduce_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; valid ops: {', '.join(REDUCE_OPS)}")
    return op


def reduced_as(op: str) -> str:
    """The reduction an algorithm runs for `op`: an average is a sum, divided once at the end
    by the caller (Group), so that no algorithm or transport needs to know of it."""
    return "sum" if op == "avg" else op


def combine_(acc: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
    """acc <- acc (op) other, in place. `avg` is reduced as a sum and divided once at the end."""
    if op in ("sum", "avg"):
        return acc.add_(other)
    if op == "max":
        return torch.maximum(acc, other, out=acc)
    if op == "min":
        return torch.minimum(acc, other, out=acc)
    raise ValueError(f"unknown reduce op {op!r}")


def divide_(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Finish an `avg`: divide by the world size (integers truncate, as NCCL's AVG does)."""
    if world_size == 1:
        return tensor
    if tensor.is_floating_point():
        return tensor.div_(world_size)
    return tensor.copy_(torch.div(tensor, world_size, rounding_mode="trunc"))


def part_sizes(count: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous pieces of `count` elements; the first `count % parts` get one more.

    This is torch.tensor_split's rule; every collective uses it, so counts that do not divide
    by the world size are handled the same way everywhere.
    """
    base, extra = divmod(count, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def part_size(count: int, parts: int, index: int) -> int:
    """part_sizes(count, parts)[index], without the list (every reduce-scatter and all-gather
    call checks its buffer's size with it)."""
    base, extra = divmod(count, parts)
    return base + (index < extra)


def split_parts(flat: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    """Views of the `parts` pieces of `part_sizes(flat.numel(), parts)`, made in one call."""
    return flat.tensor_split(parts)


def part_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """(start, end) element offsets of each part of `part_sizes(count, parts)`."""
    bounds, start = [], 0
    for size in part_sizes(count, parts):
        bounds.append((start, start + size))
        start += size
    return bounds


class Splits(NamedTuple):
    """An all-to-all's parts when they are uneven, in elements of the flat buffers: send[j]
    elements of the input go to rank j, receive[i] elements of the output come from rank i
    (row counts times the elements of a row: the algorithms see flat buffers only)."""

    send: tuple[int, ...]
    receive: tuple[int, ...]


def all_to_all_parts(input: torch.Tensor, output: torch.Tensor, parts: int,
                     splits: Splits | None) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Views of the input's part for each rank and of the output's part from each rank:
    `splits`' sizes, or without them the equal parts of torch.tensor_split's rule (rank r
    receives `parts` pieces of part r of an input)."""
    if splits is None:
        return split_parts(input, parts), split_parts(output, parts)
    return input.split(splits.send), output.split(splits.receive)


def splits_mismatch(every: list[Splits]) -> str:
    """What is wrong with every rank's splits (every[i] is rank i's) taken together, in one
    line; "" when each rank receives from each peer what that peer sends it."""
    if [theirs.send for theirs in every] == list(zip(*(theirs.receive for theirs in every))):
        return ""  # every call that is right (all but a bug's) takes only this one comparison
    for source, theirs in enumerate(every):
        for target, count in enumerate(theirs.send):
            expected = every[target].receive[source]
            if count != expected:
                return (f"rank {source} sends {count} elements to rank {target}, which expects "
                        f"{expected} from it (input_split_sizes[{target}] on rank {source} and "
                        f"output_split_sizes[{source}] on rank {target} must count the same rows)")
    return ""

"""`--init-from`: each rank reads only its own part of a Hugging Face model's tensors.

A rank's part of a parameter is what the layout leaves it: its rows of a tensor-parallel split
(fused blocks, as [q | k | v], a slice of each) and, under expert parallelism, its experts. The
name mapping (hf_weights.py) says where that part lies in the HF tensor: the same rows, or, where
HF stores the matrix transposed (GPT-2's Conv1D, Mixtral's experts), the other dimension; and
for stacked experts, which HF tensors (one per expert) to open at all. safetensors' `get_slice`
then reads no more of the file than that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.comm.ops import part_bounds


@dataclass(frozen=True)
class Cut:
    """This rank's part of one parameter: tensor-parallel (dim, fused parts, rank, size) and
    expert-parallel (rank, size) splits, either None."""

    tp: tuple[int, int, int, int] | None = None
    ep: tuple[int, int] | None = None


def row_ranges(length: int, parts: int, rank: int, size: int) -> list[tuple[int, int]]:
    """The ranges of a dimension of `length` that rank keeps, as layers.shard cuts it: a part of
    part_bounds; with fused parts, its slice of each block."""
    if parts == 1:
        return [part_bounds(length, size)[rank]]
    block = length // parts
    chunk = block // size
    return [(b * block + rank * chunk, b * block + (rank + 1) * chunk) for b in range(parts)]


def local_cuts(state) -> dict[str, Cut]:
    """Our name -> this rank's Cut, for every parameter it holds (train_state.TrainState)."""
    cuts = {}
    for name, layout, param in state.parameters():
        tp = None if layout is None else (layout[0], layout[1], state.tp_group.rank, state.tp_group.size)
        split = state.ep_group is not None and getattr(param, "expert_parallel", False)
        cuts[name] = Cut(tp, (state.ep_group.rank, state.ep_group.size) if split else None)
    return cuts


def read_local(directory, fmt, name: str, cut: Cut, like: torch.Tensor) -> torch.Tensor:
    """Our parameter `name`'s part for `cut`, read from the HF directory; `like`: the whole
    parameter (its shape; it may be on the meta device)."""
    rule, hf = fmt.rule(name)
    if hf is None:  # a tensor HF does not have (its export refused anything but zeros)
        return torch.zeros(like.shape, dtype=like.dtype)
    names = fmt.hf_names(name)
    if rule.per_expert:
        if cut.ep is not None:
            (start, end), = row_ranges(len(names), 1, *cut.ep)
            names = names[start:end]
        parts = directory.read(names)
        return torch.stack([parts[n].t() if rule.transpose else parts[n] for n in names])
    if cut.tp is None:
        tensor = directory.read(names)[names[0]]
        return tensor.t() if rule.transpose else tensor
    dim, fused, rank, size = cut.tp
    ranges = row_ranges(like.shape[dim], fused, rank, size)
    hf_dim = (1 - dim) if rule.transpose and like.dim() == 2 else dim
    tensor = directory.read_rows(names[0], hf_dim, ranges)
    return tensor.t() if rule.transpose else tensor

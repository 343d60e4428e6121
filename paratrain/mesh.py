"""Mesh(dp, pp, tp): the world's ranks laid out as a (dp, pp, tp) grid, one Group per axis.

The grid is `arange(world).view(dp, pp, tp)`: tensor-parallel ranks are adjacent (they talk
most, on every layer, so they belong on the fastest links, as in Megatron), then pipeline
stages, and data-parallel replicas are farthest apart (they talk once per step).

    rank = (dp_index * pp + pp_index) * tp + tp_index

Each rank gets three Groups: `tp` (same dp, pp), `pp` (same dp, tp), `dp` (same pp, tp). An
axis that spans the whole world (dp when pp = tp = 1) is the world's group itself, so the trivial
mesh (world, 1, 1) costs nothing: training always builds one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AXES = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Coordinates:
    dp: int
    pp: int
    tp: int


def mesh_grid(dp: int, pp: int, tp: int) -> torch.Tensor:
    return torch.arange(dp * pp * tp).view(dp, pp, tp)


def axis_partition(grid: torch.Tensor, axis: str) -> list[list[int]]:
    """The groups along `axis`: lists of ranks that differ only in that coordinate."""
    dim = AXES.index(axis)
    moved = grid.movedim(dim, -1).reshape(-1, grid.shape[dim])
    return [row.tolist() for row in moved]


class Mesh:
    def __init__(self, world, dp: int = 1, pp: int = 1, tp: int = 1):
        for name, value in (("dp", dp), ("pp", pp), ("tp", tp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh: {name} must be a positive integer, got {value!r}")
        if dp * pp * tp != world.size:
            raise ValueError(
                f"mesh: world size {world.size} != dp x pp x tp = {dp} x {pp} x {tp} = {dp * pp * tp}"
            )
        self.world, self.shape = world, {"dp": dp, "pp": pp, "tp": tp}
        self.grid = mesh_grid(dp, pp, tp)
        index = (self.grid == world.rank).nonzero()[0].tolist()
        self.coords = Coordinates(*index)
        # Every rank splits along every axis in the same order: process groups need that.
        self.groups = {axis: self._group_along(axis) for axis in AXES}

    def _group_along(self, axis: str):
        partition = axis_partition(self.grid, axis)
        if partition == [list(range(self.world.size))]:
            return self.world  # the same ranks in the same order: no new group to make
        return self.world.split(partition)

    @property
    def dp(self):
        return self.groups["dp"]

    @property
    def pp(self):
        return self.groups["pp"]

    @property
    def tp(self):
        return self.groups["tp"]

    def rank_at(self, dp: int, pp: int, tp: int) -> int:
        return int(self.grid[dp, pp, tp])

    def describe(self) -> str:
        s = self.shape
        return f"mesh dp={s['dp']} x pp={s['pp']} x tp={s['tp']} (rank {self.world.rank} at {self.coords})"

    def close(self) -> None:
        """Close the groups this mesh made (the world's is its owner's to close)."""
        for group in self.groups.values():
            if group is not self.world:
                group.close()

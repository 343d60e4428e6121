"""Mesh(dp, pp, cp, tp): the world's ranks laid out as a (dp, pp, cp, tp) grid, one Group per axis.

The grid is `arange(world).view(dp, pp, cp, tp)`, picotron's order. Tensor-parallel ranks are
adjacent: they talk most (collectives inside every layer, on the critical path), so they belong on
the fastest links, as in Megatron. Context-parallel ranks come next: their ring also talks every
layer, but point to point and behind attention's compute, and it moves K/V blocks, less than tp's
activations. Then pipeline stages (one activation per microbatch), and data-parallel replicas
farthest apart (they talk once per step).

    rank = ((dp_index * pp + pp_index) * cp + cp_index) * tp + tp_index

Each rank gets a Group per axis: `tp` (same dp, pp, cp), `cp` (same dp, pp, tp), `pp` (same dp,
cp, tp), `dp` (same pp, cp, tp), and `dp_cp`, the ranks that hold the same parameters (same pp
and tp): under context parallelism every cp rank of a replica computes gradients for its part of
the sequences, so gradients are reduced, and ZeRO/FSDP shard, over dp x cp (torchtitan's rule).
A group whose ranks another axis already made (dp_cp when cp = 1; any axis of size 1 beside
another) is that group, not a new one; an axis spanning the whole world is the world's group, so
the trivial mesh (world, 1, 1, 1) costs nothing: training always builds one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AXES = ("dp", "pp", "cp", "tp")
# The groups a mesh makes: each axis, then the flattened data-parallel one (dims of the grid).
GROUPS = {"dp": ("dp",), "pp": ("pp",), "cp": ("cp",), "tp": ("tp",), "dp_cp": ("dp", "cp")}


@dataclass(frozen=True)
class Coordinates:
    dp: int
    pp: int
    cp: int
    tp: int


def mesh_grid(dp: int, pp: int, tp: int, cp: int = 1) -> torch.Tensor:
    return torch.arange(dp * pp * cp * tp).view(dp, pp, cp, tp)


def axis_partition(grid: torch.Tensor, axis: str | tuple[str, ...]) -> list[list[int]]:
    """The groups along `axis` (or several axes, flattened): lists of ranks that differ only in
    those coordinates, numbered in the grid's order."""
    axes = (axis,) if isinstance(axis, str) else axis
    dims = [AXES.index(a) for a in axes]
    size = 1
    for dim in dims:
        size *= grid.shape[dim]
    moved = grid.movedim(dims, list(range(grid.dim() - len(dims), grid.dim()))).reshape(-1, size)
    return [row.tolist() for row in moved]


def expert_partitions(grid: torch.Tensor, ep: int) -> dict[str, list[list[int]]]:
    """The ep groups (each dp x cp group cut into blocks of `ep` consecutive ranks, as torchtitan
    and Megatron take the experts' ranks from the data axis) and the edp groups (the ranks at the
    same place in every block: they hold the same experts)."""
    ep_groups, edp_groups = [], []
    for data_ranks in axis_partition(grid, ("dp", "cp")):
        blocks = [data_ranks[i:i + ep] for i in range(0, len(data_ranks), ep)]
        ep_groups += blocks
        edp_groups += [list(column) for column in zip(*blocks)]
    return {"ep": sorted(ep_groups), "edp": sorted(edp_groups)}


class Mesh:
    def __init__(self, world, dp: int = 1, pp: int = 1, tp: int = 1, *, cp: int = 1, ep: int = 1):
        for name, value in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh: {name} must be a positive integer, got {value!r}")
        if dp * pp * cp * tp != world.size:
            raise ValueError(f"mesh: world size {world.size} != dp x pp x cp x tp = "
                             f"{dp} x {pp} x {cp} x {tp} = {dp * pp * cp * tp}")
        self.world, self.shape = world, {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        self.grid = mesh_grid(dp, pp, tp, cp)
        index = (self.grid == world.rank).nonzero()[0].tolist()
        self.coords = Coordinates(*index)
        # Every rank makes the groups in the same order: process groups need that.
        made: dict[tuple, object] = {}
        if not isinstance(ep, int) or ep < 1 or (dp * cp) % ep:
            raise ValueError(f"mesh: ep ({ep!r}) must divide dp x cp = {dp * cp}: the experts' ranks are data ranks")
        self.ep_size = ep
        partitions = {name: axis_partition(self.grid, axes) for name, axes in GROUPS.items()}
        if ep > 1:  # with ep 1 every rank holds every expert: edp is dp_cp, and no group of one is made
            partitions.update(expert_partitions(self.grid, ep))
        self.groups = {name: self._group_of(partition, made) for name, partition in partitions.items()}

    def _group_of(self, partition: list[list[int]], made: dict):
        key = tuple(map(tuple, partition))
        if key not in made:
            whole = partition == [list(range(self.world.size))]
            made[key] = self.world if whole else self.world.split(partition)  # the world: no new group
        return made[key]

    @property
    def dp(self):
        return self.groups["dp"]

    @property
    def pp(self):
        return self.groups["pp"]

    @property
    def cp(self):
        return self.groups["cp"]

    @property
    def tp(self):
        return self.groups["tp"]

    @property
    def dp_cp(self):
        """The ranks holding the same parameters: gradients are reduced over them."""
        return self.groups["dp_cp"]

    @property
    def ep(self):
        """Expert parallelism: the ranks that split the experts between them (consecutive data
        ranks); None when ep is 1."""
        return self.groups.get("ep")

    @property
    def edp(self):
        """The ranks that hold the same experts: the experts' gradients are reduced over them."""
        return self.groups.get("edp", self.dp_cp)

    def rank_at(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        return int(self.grid[dp, pp, cp, tp])

    def describe(self) -> str:
        s = self.shape
        cp = f" x cp={s['cp']}" if s["cp"] > 1 else ""
        return f"mesh dp={s['dp']} x pp={s['pp']}{cp} x tp={s['tp']} (rank {self.world.rank} at {self.coords})"

    def close(self) -> None:
        """Close the groups this mesh made (the world's is its owner's to close)."""
        closed = set()
        for group in self.groups.values():
            if group is not self.world and id(group) not in closed:
                closed.add(id(group))
                group.close()

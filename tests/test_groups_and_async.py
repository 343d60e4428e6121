"""Async collectives keep call order across ranks; Group.split and Mesh give working subgroups."""

from __future__ import annotations

import pytest
import torch

from paratrain import run
from paratrain.mesh import Mesh, axis_partition, mesh_grid


def async_then_blocking(group):
    tensors = [torch.full((1000,), float(group.rank + i)) for i in range(4)]
    handles = [group.all_reduce(t, algo=a, async_op=True) for t, a in zip(tensors, ["ring", "hd", "native", "tree"])]
    blocking = torch.ones(3)
    group.all_reduce(blocking)  # queued behind the async calls: same order on every rank
    results = [handle.wait() for handle in handles]
    assert all(r is t for r, t in zip(results, tensors))
    assert all(h.finished >= h.started for h in handles)
    return [t[0].item() for t in tensors], blocking.tolist()


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_async_collectives_complete_in_call_order(world_size):
    results = run(async_then_blocking, world_size)
    base = sum(range(world_size))
    for values, blocking in results.values():
        assert values == [float(base + i * world_size) for i in range(4)]
        assert blocking == [float(world_size)] * 3


def sums_in_subgroups(group):
    halves = group.split([[0, 2], [1, 3]])
    t = torch.tensor([float(group.rank)])
    halves.all_reduce(t, algo="ring")
    return halves.rank, halves.size, t.item()


def test_split_gives_each_rank_its_subgroup_numbered_by_position():
    results = run(sums_in_subgroups, 4)
    assert results == {0: (0, 2, 2.0), 1: (0, 2, 4.0), 2: (1, 2, 2.0), 3: (1, 2, 4.0)}


def bad_split(group):
    group.split([[0, 1], [1]])


def test_split_rejects_a_partition_that_is_not_one():
    with pytest.raises(ValueError, match="must list each rank of 0..1 exactly once"):
        run(bad_split, 2)


def test_mesh_grid_puts_tensor_parallel_ranks_next_to_each_other():
    grid = mesh_grid(2, 2, 2)
    assert axis_partition(grid, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_partition(grid, "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_partition(grid, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def mesh_sums(group, shape):
    mesh = Mesh(group, *shape)
    sums = {}
    for axis in ("dp", "pp", "tp"):
        t = torch.tensor([float(group.rank)])
        getattr(mesh, axis).all_reduce(t, algo="native")
        sums[axis] = t.item()
    mesh.close()
    return mesh.coords, sums


def test_mesh_axis_groups_reduce_over_the_right_ranks():
    results = run(mesh_sums, 8, args=((2, 2, 2),))
    for rank, (coords, sums) in results.items():
        assert rank == (coords.dp * 2 + coords.pp) * 2 + coords.tp
        assert sums["tp"] == rank + (rank ^ 1)
        assert sums["pp"] == rank + (rank ^ 2)
        assert sums["dp"] == rank + (rank ^ 4)


def test_mesh_axis_groups_work_on_process_groups():
    """Four processes: torch.distributed subgroups built by their members only."""
    results = run(mesh_sums, 4, launcher="processes", args=((2, 2, 1),))
    for rank, (coords, sums) in results.items():
        assert sums == {"tp": rank, "pp": rank + (rank ^ 1), "dp": rank + (rank ^ 2)}


def test_mesh_rejects_a_world_that_is_not_dp_pp_tp():
    with pytest.raises(ValueError, match=r"world size 4 != dp x pp x cp x tp = 1 x 2 x 1 x 3 = 6"):
        run(lambda g: Mesh(g, 1, 2, 3), 4)


def test_mesh_puts_context_ranks_between_tensor_and_pipeline_and_reduces_gradients_over_dp_and_cp():
    grid = mesh_grid(2, 1, 2, cp=2)  # dp 2, pp 1, cp 2, tp 2
    assert axis_partition(grid, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_partition(grid, "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_partition(grid, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_partition(grid, ("dp", "cp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]

    def sums(group):
        mesh = Mesh(group, 2, 1, 2, cp=2)
        out = {}
        for axis in ("cp", "dp_cp"):
            t = torch.tensor([float(group.rank)])
            mesh.groups[axis].all_reduce(t, algo="native")
            out[axis] = t.item()
        mesh.close()
        return mesh.coords, out

    for rank, (coords, out) in run(sums, 8).items():
        assert rank == ((coords.dp * 1 + coords.pp) * 2 + coords.cp) * 2 + coords.tp
        assert out == {"cp": rank + (rank ^ 2), "dp_cp": sum(r for r in range(8) if r % 2 == rank % 2)}


def test_a_mesh_makes_no_group_twice():
    """cp 1: the cp group is another size-1 axis's, and dp x cp is dp."""
    def made(group):
        mesh = Mesh(group, 2, 2, 1)
        return mesh.dp_cp is mesh.dp, mesh.cp is mesh.tp

    assert set(run(made, 4).values()) == {(True, True)}

"""Every collective x every algorithm on the in-process fabric, against a reference computed
in the test from all ranks' inputs.

A rank's input is a deterministic function of (rank, count, dtype, op), so each rank knows
every other rank's input and the expected result without communicating. One `paratrain.run` per
(op, world size, dtype) sweeps algorithms x counts x roots, each with the reduce ops in turn
(collective_checks.reduce_cases), and x layouts; each rank writes down every difference it sees,
so a failure lists all the cases that differed, not just the first. The checkers are in collective_checks.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

import paratrain
from paratrain.comm import Group
from paratrain.comm.algorithms import algorithms_for

from collective_cases import DTYPES, RUN_TIMEOUT_S, WORLD_SIZES, dtype_name
from collective_checks import SWEEPS, assert_no_failures, checking, sweep, sweep_with_small_segments

# ---- tests ------------------------------------------------------------------------------------

# Every dtype at every world size but the largest; at 8 ranks (a third of the file's time when
# it ran all four) float32, and bfloat16, whose 8 significant bits are where a sum of 8 ranks'
# inputs is still exact only if every rank's part is folded in once. float16 and int64 take the
# same paths (the dtype only picks the reduction kernel) at 1 to 5 ranks.
CASES = [(n, dtype) for n in WORLD_SIZES for dtype in DTYPES
         if n != max(WORLD_SIZES) or dtype in (torch.float32, torch.bfloat16)]
matrix = pytest.mark.parametrize("world_size, dtype", CASES,
                                 ids=[f"x{n}-{dtype_name(dtype)}" for n, dtype in CASES])


def _run_sweep(op_name, world_size, dtype):
    results = paratrain.run(sweep, world_size, args=(op_name, [dtype]), timeout=RUN_TIMEOUT_S)
    assert sorted(results) == list(range(world_size))
    assert_no_failures(results)


@matrix
def test_all_reduce_matches_reference_for_every_algorithm(world_size, dtype):
    _run_sweep("all_reduce", world_size, dtype)


@matrix
def test_reduce_scatter_gives_each_rank_its_reduced_part(world_size, dtype):
    _run_sweep("reduce_scatter", world_size, dtype)


@matrix
def test_all_gather_concatenates_every_ranks_part(world_size, dtype):
    _run_sweep("all_gather", world_size, dtype)


@matrix
def test_broadcast_copies_the_roots_tensor_to_every_rank(world_size, dtype):
    _run_sweep("broadcast", world_size, dtype)


@matrix
def test_reduce_reaches_the_root_and_leaves_other_ranks_unchanged(world_size, dtype):
    _run_sweep("reduce", world_size, dtype)


@matrix
def test_all_to_all_sends_part_j_of_every_input_to_rank_j(world_size, dtype):
    _run_sweep("all_to_all", world_size, dtype)


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
@pytest.mark.parametrize("op_name", list(SWEEPS))
def test_segmented_algorithms_match_reference(op_name, world_size):
    results = paratrain.run(
        sweep_with_small_segments, world_size, args=(op_name, [torch.float32]), timeout=RUN_TIMEOUT_S
    )
    assert_no_failures(results)


def _sweep_halving_doubling(group: Group, op_name: str) -> list[str]:
    return sweep(group, op_name, [torch.int64, torch.float16], algos=["hd"])


@pytest.mark.parametrize("world_size", [6, 7])
@pytest.mark.parametrize("op_name", ["all_reduce", "reduce_scatter", "all_gather"])
def test_halving_doubling_folds_several_extra_ranks_correctly(op_name, world_size):
    """6 and 7 ranks fold two and three pairs into one virtual rank each (in the matrix, 3 and
    5 ranks fold only one pair)."""
    results = paratrain.run(_sweep_halving_doubling, world_size, args=(op_name,), timeout=RUN_TIMEOUT_S)
    assert_no_failures(results)


def _count_arrivals_around_barriers(group, algos, rounds, arrivals, lock):
    """Each rank counts itself in before a barrier and reads the count after it: a barrier
    that lets a rank through early shows as a count below the world size."""
    seen = {}
    for algo in algos:
        for round_ in range(rounds):
            with lock:
                arrivals[algo, round_] = arrivals.get((algo, round_), 0) + 1
            with checking(f"barrier(algo={algo}) round {round_}"):
                group.barrier(algo=algo)
            with lock:
                seen[algo, round_] = arrivals[algo, round_]
    return seen


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_barrier_releases_no_rank_before_every_rank_arrives(world_size):
    algos = algorithms_for("barrier")
    results = paratrain.run(
        _count_arrivals_around_barriers, world_size,
        args=(algos, 5, {}, threading.Lock()), timeout=RUN_TIMEOUT_S,
    )
    early = {
        (rank, key): count
        for rank, seen in results.items() for key, count in seen.items() if count != world_size
    }
    assert not early, f"(rank, (algo, round)): ranks arrived when it left the barrier: {early}"

"""The collectives on real processes over gloo: every op x every algorithm (ours over the
processes' p2p, gloo's own as "native", and "auto") against the same references as the fabric
matrix. The ranks share this host, so their transport is shared memory ("shm") over a gloo group.

A launch costs seconds (spawning ranks that import torch), so each world size gets one launch
that runs every check and returns the differences; the function it runs is module-level,
since it is pickled to the spawned ranks.
"""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.comm.algorithms import algorithms_for

# The same checkers and references as the fabric matrix; the spawned ranks import them too.
from collective_checks import SWEEPS, assert_no_failures, checking, sweep, sweep_with_small_segments

RUN_TIMEOUT_S = 60.0


def gloo_counts(world_size: int) -> list[int]:
    """Empty, fewer than the ranks, uneven parts, even parts, and 70001 float32 (over 256 KiB,
    where `auto` picks ring for reduce_scatter on gloo)."""
    return sorted({0, 1, world_size - 1, 2 * world_size + 1, 4 * world_size, 70001})


def check_everything_on_this_rank(group) -> dict:
    failures = []
    for op_name in SWEEPS:
        failures += sweep(group, op_name, [torch.float32, torch.int64], counts=gloo_counts(group.size))
        failures += sweep_with_small_segments(group, op_name, [torch.float32])
    for algo in algorithms_for("barrier", group.kind):
        with checking(f"barrier(algo={algo})"):
            group.barrier(algo=algo)
    return {"transport": group.kind, "failures": failures}


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_collective_and_algorithm_matches_reference_on_gloo(world_size):
    results = paratrain.run(
        check_everything_on_this_rank, world_size, launcher="processes", timeout=RUN_TIMEOUT_S
    )
    assert sorted(results) == list(range(world_size))
    assert {result["transport"] for result in results.values()} == {"shm"}
    assert_no_failures({rank: result["failures"] for rank, result in results.items()})


def test_every_collective_and_algorithm_matches_reference_over_gloo_sockets(monkeypatch):
    """PARATRAIN_SHM=0: every message over gloo's sockets, and no shared-segment algorithm."""
    monkeypatch.setenv("PARATRAIN_SHM", "0")
    results = paratrain.run(check_everything_on_this_rank, 2, launcher="processes", timeout=RUN_TIMEOUT_S)
    assert {result["transport"] for result in results.values()} == {"gloo"}
    assert_no_failures({rank: result["failures"] for rank, result in results.items()})

"""The collectives through a group's shared segment (comm/transport/shm_arena.py,
comm/algorithms/shared.py): messages larger than a slot pass in pieces through both halves and
match the references; calls of every op follow each other without a barrier between them (the
halves' turns are all that keeps a rank from overwriting what a peer still reads); only groups
whose ranks all share this host have a segment, and asking for its algorithms elsewhere says
why; a silent peer times out and a peer that exits is named; nothing is left in /dev/shm.

The sweeps of every op, algorithm and size below a slot run in test_collectives_gloo.py.
"""

from __future__ import annotations

import functools
import json
import os
import time

import pytest
import torch

import paratrain
from paratrain.comm import CommTimeoutError, Group
from paratrain.comm.transport.shm_arena import LINE, arena_bytes, slot_bytes_for

from collective_checks import (
    Report, assert_no_failures, check_all_gather, check_all_reduce, check_all_to_all, check_broadcast,
    check_reduce, check_reduce_scatter,
)
from test_failures import rank_1_leaves, run_two_gloo_ranks
from test_p2p import RUN_TIMEOUT_S

SHARED = ("oneshot", "twoshot")


def test_a_slot_is_whole_lines_and_the_segment_stays_within_its_budget():
    for ranks in (2, 3, 4, 8, 64, 256):
        slot = slot_bytes_for(ranks)
        assert slot % LINE == 0 and slot >= 64 << 10
        assert arena_bytes(ranks) <= ranks * LINE + max(16 << 20, 2 * ranks * (64 << 10))


def _pieces_of_every_op(group) -> dict:
    """Counts of 2 to 3 slots (so 2-3 pieces, both halves, and a short last one), float32 and
    int64, every op and reduce op of the shared algorithms.

    A covering, not every combination: the all-reduce runs each dtype with each reduce op (the
    two pick between the native kernel and torch's ops), on one of the two algorithms in turn,
    so each algorithm meets each dtype and each reduce op too. The reduce-scatter and reduce
    take the reduce ops in turn over the dtypes (two each): their pieces are combined by torch's
    op for the reduce op whatever the dtype (shared._reduce_rows), and every pairing of the
    two runs below a slot in test_collectives_gloo.py."""
    report = Report(group)
    elements = slot_bytes_for(group.size) // 4  # float32 elements in a slot
    big = 2 * elements + 7 * group.size + 1
    for d, dtype in enumerate((torch.float32, torch.int64)):
        for o, op in enumerate(("sum", "avg", "max", "min")):
            check_all_reduce(group, report, SHARED[(d + o) % 2], dtype, big, op)
        for op in (("sum", "max"), ("avg", "min"))[d]:
            check_reduce_scatter(group, report, "oneshot", dtype, group.size * big // 2 + 3, op)
            check_reduce(group, report, "oneshot", dtype, big, 0, op)
        check_all_gather(group, report, "oneshot", dtype, big + 5)
        check_broadcast(group, report, "oneshot", dtype, big, group.size - 1)
        check_all_to_all(group, report, "oneshot", dtype, group.size * big // 2)
    return {"kind": group.kind, "failures": report.failures}


@pytest.mark.parametrize("world_size", [2, 3])
def test_messages_larger_than_a_slot_pass_in_pieces_and_match_the_reference(world_size):
    results = paratrain.run(_pieces_of_every_op, world_size, launcher="processes", timeout=RUN_TIMEOUT_S)
    assert {result["kind"] for result in results.values()} == {"shm"}
    assert_no_failures({rank: result["failures"] for rank, result in results.items()})


def _segment_files() -> set[str]:
    parent = f"-{os.getpid()}-"
    return {name for name in os.listdir("/dev/shm") if name.endswith("-arena") and parent in name}


def _back_to_back(group) -> list[str]:
    """Calls of different ops, sizes and algorithms with no barrier between them, each rank
    checking every result against what it must be; rank 1 sleeps now and then, so rank 0 runs
    ahead to the next call while rank 1 still reads the last one's half."""
    failures = []
    n, me = group.size, group.rank
    for step in range(60):
        count = (1, 1000, 70001, 300000)[step % 4]
        algo = SHARED[step % 2]
        tensor = torch.full((count,), float(me + step))
        group.all_reduce(tensor, algo=algo)
        if not torch.equal(tensor, torch.full((count,), float(sum(range(n)) + n * step))):
            failures.append(f"step {step}: all_reduce {algo} of {count}")
        gathered = torch.empty(n * count)
        group.all_gather(gathered, torch.full((count,), float(me * step)), algo="oneshot")
        expected = torch.cat([torch.full((count,), float(r * step)) for r in range(n)])
        if not torch.equal(gathered, expected):
            failures.append(f"step {step}: all_gather of {count} per rank")
        if me == 1 and step % 7 == 0:
            time.sleep(0.01)
    return failures


def test_calls_follow_each_other_without_a_barrier_and_never_read_a_half_being_rewritten():
    """Also: the run leaves no segment file behind (one run serves both checks)."""
    before = _segment_files()
    results = paratrain.run(_back_to_back, 3, launcher="processes", timeout=RUN_TIMEOUT_S)
    assert_no_failures(results)
    assert _segment_files() == before


def _asks_for_oneshot(group) -> str:
    try:
        group.all_reduce(torch.ones(4), algo="oneshot")
    except ValueError as error:
        return str(error)
    return "ran"


def test_threads_and_groups_over_sockets_have_no_segment_and_say_why(monkeypatch):
    said = paratrain.run(_asks_for_oneshot, 2, launcher="threads")
    assert all("only where every rank of the group is a process of this host" in text for text in said.values())
    assert "transport is 'fabric'" in said[0]
    monkeypatch.setenv("PARATRAIN_SHM", "0")
    said = paratrain.run(_asks_for_oneshot, 2, launcher="processes", timeout=RUN_TIMEOUT_S)
    assert "transport is 'gloo'" in said[1]


def _silent_peer(group) -> str:
    if group.rank == 0:
        try:
            Group(group.transport, timeout=0.5).barrier(algo="oneshot")
            seen = "returned"
        except CommTimeoutError as error:
            seen = str(error)
    else:
        seen = ""
        time.sleep(1.0)
        Group(group.transport, timeout=30).barrier(algo="oneshot")  # the step rank 0 took: now both have
    group.barrier()
    return seen


def test_a_silent_peer_times_out_naming_it():
    said = paratrain.run(_silent_peer, 2, launcher="processes", timeout=RUN_TIMEOUT_S)
    assert said[0].startswith("rank 0: barrier (call #1) timed out after 0.5s waiting for rank 1"), said[0]


def _all_reduce_through_the_segment(group) -> None:
    group.all_reduce(torch.ones(8), algo="oneshot")


@pytest.mark.timeout(60)  # the group's timeout is 60 s: finishing first means the exit was noticed
def test_a_peer_that_exits_mid_collective_is_named(tmp_path):
    exit_codes, result_file = run_two_gloo_ranks(functools.partial(
        rank_1_leaves, together=_all_reduce_through_the_segment, waiting=_all_reduce_through_the_segment), tmp_path)
    assert exit_codes == [0, 3]
    seen = json.loads(result_file.read_text())
    assert seen["shm"] and seen["peer"] == 1
    assert seen["text"].startswith("rank 0: all_reduce (call #2) lost rank 1: rank 1's process (pid "), seen
    assert "has exited" in seen["text"]


def _late_peer(group) -> list[str]:
    """Rank 0 arrives late, so rank 1 waits long enough to sleep on its doorbell (no polling:
    PARATRAIN_SHM_SPIN_US=0), on the main thread and on the communication thread."""
    failures = []
    for async_op in (False, True):
        if group.rank == 0:
            time.sleep(0.3)
        tensor = torch.full((1000,), float(group.rank + 1))
        handle = group.all_reduce(tensor, algo="oneshot", async_op=async_op)
        if async_op:
            handle.wait()
        if not torch.equal(tensor, torch.full((1000,), 3.0)):
            failures.append(f"rank {group.rank}: a sleeping waiter's all-reduce (async {async_op}) is wrong")
    group.close()
    return failures


def test_a_rank_asleep_in_a_step_is_woken_by_its_peer(monkeypatch):
    monkeypatch.setenv("PARATRAIN_SHM_SPIN_US", "0")
    assert_no_failures(paratrain.run(_late_peer, 2, launcher="processes", timeout=RUN_TIMEOUT_S))

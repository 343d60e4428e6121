"""Replays (comm/replays.py): the second all-reduce on a tensor records its messages, every
later one replays them. A replay must give what a fresh call gives, build nothing, and never
outlive or outguess its tensor. Which calls run straight from a replay: test_straight_calls.py."""

from __future__ import annotations

import gc

import pytest
import torch

import paratrain
from paratrain.comm import Group
from paratrain.comm.algorithms import ALGORITHMS
from paratrain.comm.link import Link

RUN_TIMEOUT_S = 60.0


def values(rank: int, call: int, count: int) -> torch.Tensor:
    """Rank `rank`'s input for call `call`: different on every rank and every call."""
    return torch.arange(count, dtype=torch.float64).mul_(rank + 1).add_(call * 7 + rank)


def expected(size: int, call: int, count: int) -> torch.Tensor:
    return sum(values(r, call, count) for r in range(size))


def repeated_all_reduces(group: Group, algo: str, count: int, calls: int) -> list[str]:
    """`calls` all-reduces of one tensor, refilled in place before each: every result checked."""
    tensor = torch.empty(count, dtype=torch.float64)
    wrong = []
    for call in range(calls):
        tensor.copy_(values(group.rank, call, count))
        group.all_reduce(tensor, algo=algo)
        if not torch.equal(tensor, expected(group.size, call, count)):
            wrong.append(f"rank {group.rank} call {call}: wrong sum")
    if group.replays.recorded != 1:
        wrong.append(f"rank {group.rank}: {group.replays.recorded} replays recorded for one tensor")
    return wrong


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.parametrize("algo", ["ring", "hd"])
def test_repeated_calls_on_one_tensor_replay_one_recording_and_sum_right(algo, world_size, monkeypatch):
    """The second call records the replay; the algorithm never runs again; every sum is exact.
    1003 elements: parts of unequal size; a 16-byte segment makes every step several messages."""
    runs = []
    original = ALGORITHMS["all_reduce"][algo]

    def counted(link, buf, op):
        runs.append(link.rank)
        original(link, buf, op)

    monkeypatch.setitem(ALGORITHMS["all_reduce"], algo, counted)

    def body(group):
        segmented = Group(group.transport, timeout=group.timeout, table=group.table, segment_bytes=16)
        return repeated_all_reduces(group, algo, 1003, 4) + repeated_all_reduces(segmented, algo, 1003, 4)

    results = paratrain.run(body, world_size, timeout=RUN_TIMEOUT_S)
    assert [line for rank in results for line in results[rank]] == []
    assert sorted(runs) == sorted(list(range(world_size)) * 4)  # twice per rank and group


def compiled_replays(group: Group) -> list[str]:
    """gloo compiles a recording (TorchTransport.compile): ring and hd, one segment and many, sum,
    max and avg, a complex tensor (it travels as real pairs): every replayed sum exact. Where
    the messages go through shared memory they replay through Link, never compiled."""
    wrong = []
    segmented = Group(group.transport, timeout=group.timeout, table=group.table, segment_bytes=16)
    cases = [(g, algo, op, dtype) for g in (group, segmented) for algo in ("ring", "hd")
             for op, dtype in (("sum", torch.float64), ("max", torch.float64), ("avg", torch.float64),
                               ("sum", torch.complex128))]
    for g, algo, op, dtype in cases:
        if algo == "hd" and g.size & (g.size - 1):
            continue  # halving-doubling wants a power of two
        tensor = torch.empty(1003, dtype=dtype)
        for call in range(4):
            inputs = [values(r, call, 1003).to(dtype) * (1 + 1j if dtype.is_complex else 1) for r in range(g.size)]
            tensor.copy_(inputs[g.rank])
            g.all_reduce(tensor, op=op, algo=algo)
            stacked = torch.stack(inputs)
            want = {"sum": stacked.sum(0), "max": stacked.real.amax(0).to(dtype), "avg": stacked.sum(0) / g.size}[op]
            if not torch.allclose(tensor, want, rtol=1e-12, atol=0):
                wrong.append(f"rank {g.rank} {algo} {op} {dtype} segment {g.segment_bytes} call {call}: wrong")
        kind = g.replays.kind_of(tensor)
        if kind != ("schedule" if g.kind == "shm" else "compiled"):
            wrong.append(f"rank {g.rank} {algo} {op} {dtype}: a {kind} replay on {g.kind}")
    return wrong


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("shared_memory", ["0", "1"])
def test_compiled_replays_on_gloo_processes(world_size, shared_memory, monkeypatch):
    monkeypatch.setenv("PARATRAIN_SHM", shared_memory)
    results = paratrain.run(compiled_replays, world_size, launcher="processes", timeout=RUN_TIMEOUT_S)
    assert results == {rank: [] for rank in range(world_size)}


def replay_lifetimes(group: Group) -> dict[str, object]:
    seen = {}
    tensor = torch.ones(100)
    group.all_reduce(tensor, algo="ring")
    seen["noted, not recorded, after one call"] = group.replays.held()[:2]
    group.all_reduce(tensor, algo="ring")
    seen["recorded after two"] = group.replays.held()[:2]
    del tensor
    other = torch.ones(100)
    for _ in range(2):  # the group keeps the works of the last two calls, which refer to it
        group.all_reduce(other, algo="ring")
    gc.collect()
    seen["only other's replay once the tensor is gone"] = (group.replays.held().all_reduces,
                                                           group.replays.kind_of(other))

    tensor = torch.ones(100)
    for _ in range(2):
        group.all_reduce(tensor, algo="ring")
    made = group.replays.recorded
    tensor.set_(torch.full((100,), 2.0))  # new memory under the same tensor
    for _ in range(2):
        group.all_reduce(tensor, algo="ring")
    seen["sum after set_"] = int(tensor[0].item())
    seen["new memory, new recording"] = group.replays.recorded - made

    for algo, op in (("hd", "sum"), ("hd", "max")):  # another algorithm, another reduction: new recordings
        for _ in range(2):
            group.all_reduce(tensor, op=op, algo=algo)
    seen["recorded for hd and max"] = group.replays.recorded - made - 1

    made = group.replays.recorded
    strided = torch.ones(100, 2)[:, 0]  # not contiguous: reduced through a copy, never recorded
    for _ in range(3):
        group.all_reduce(strided, algo="ring")
    seen["strided sum"] = int(strided.sum().item())
    kept = torch.ones(100)
    for algo in ("tree", "direct"):  # they fold outside their messages: never replayed
        for _ in range(3):
            group.all_reduce(kept, algo=algo)
    seen["recorded for strided, tree and direct"] = group.replays.recorded - made
    return seen


def test_a_replay_lives_as_long_as_its_tensor_and_fits_only_its_memory_algorithm_and_op():
    seen = paratrain.run(replay_lifetimes, 2, timeout=RUN_TIMEOUT_S)[0]
    assert seen == {
        "noted, not recorded, after one call": (0, 1), "recorded after two": (1, 0),
        "only other's replay once the tensor is gone": (1, "schedule"),
        "sum after set_": 8, "new memory, new recording": 1,
        "recorded for hd and max": 2,
        "strided sum": 800, "recorded for strided, tree and direct": 0,
    }


def test_fresh_tensors_never_push_out_the_replays_of_tensors_that_come_back():
    from paratrain.comm.replays import Replays

    def body(group):
        group.replays = Replays(capacity=3)
        bucket = torch.ones(10)
        for _ in range(2):
            group.all_reduce(bucket, algo="ring")
        fresh = [torch.ones(10) for _ in range(5)]
        for tensor in fresh:
            group.all_reduce(tensor, algo="ring")
        held = group.replays.held()
        fresh_recorded = [group.replays.kind_of(t) for t in fresh]
        del fresh[:2]  # the noted ones stay noted until their tensors go
        gc.collect()
        return held, group.replays.kind_of(bucket), fresh_recorded, group.replays.held().noted

    assert paratrain.run(body, 2, timeout=RUN_TIMEOUT_S)[0] == (
        (1, 3, 0), "schedule", [None] * 5, 3)


def test_an_algorithm_posting_its_own_messages_cannot_be_recorded():
    from paratrain.comm.transport.fabric import Fabric

    link = Link(Fabric(1).endpoint(0), "all_reduce", 1, 0, 1.0, 1 << 20)
    link.schedule = []
    with pytest.raises(RuntimeError, match="cannot be replayed"):
        link.start([])


def uneven_repeats(group: Group) -> bool:
    """Repeated calls on parts of unequal sizes (3 ranks, 3n+2 elements), in place too: the
    replayed one-shot reduce-scatter and all-gather match the reference every time."""
    from paratrain.comm.ops import part_bounds

    n, me = group.size, group.rank
    count = 3 * n + 2
    low, high = part_bounds(count, n)[me]
    full, part, gathered = torch.empty(count), torch.empty(high - low), torch.empty(count)
    mine = gathered[low:high]  # in place: the input is this rank's part of the output
    exact = True
    for step in range(4):
        full.copy_(torch.arange(count, dtype=torch.float32) + me + step)
        group.reduce_scatter(part, full, op="max")
        exact = exact and torch.equal(part, torch.arange(low, high, dtype=torch.float32) + n - 1 + step)
        mine.fill_(float(me * step))
        group.all_gather(gathered, mine)
        want = torch.cat([torch.full((b - a,), float(r * step)) for r, (a, b) in enumerate(part_bounds(count, n))])
        exact = exact and torch.equal(gathered, want)
    return exact and group.replays.held().repeats == 2  # both went straight after their second call


def test_repeated_calls_on_uneven_parts_and_in_place_match_the_reference():
    assert paratrain.run(uneven_repeats, 3, launcher="processes", timeout=RUN_TIMEOUT_S) == {0: True, 1: True, 2: True}

"""Call plans (comm/plans.py): an all-reduce on a tensor already all-reduced replays the first
call's messages. A replay must give what a fresh call gives, build nothing, and never outlive
or outguess its tensor."""

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
    if group._plans.made != 1:
        wrong.append(f"rank {group.rank}: {group._plans.made} plans made for one tensor")
    return wrong


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.parametrize("algo", ["ring", "hd"])
def test_repeated_calls_on_one_tensor_replay_one_plan_and_sum_right(algo, world_size, monkeypatch):
    """The first call builds the plan; the algorithm never runs again; every sum is exact.
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
    assert sorted(runs) == sorted(list(range(world_size)) * 2)  # once per rank and group


def test_replay_on_gloo_processes():
    results = paratrain.run(repeated_all_reduces, 2, launcher="processes", args=("ring", 5000, 3),
                            timeout=RUN_TIMEOUT_S)
    assert results == {0: [], 1: []}


def plan_lifetimes(group: Group) -> dict[str, int]:
    seen = {}
    tensor = torch.ones(100)
    group.all_reduce(tensor, algo="ring")
    seen["kept"] = len(group._plans)
    del tensor
    other = torch.ones(100)
    for _ in range(2):  # the group keeps the works of the last two calls, which refer to it
        group.all_reduce(other, algo="ring")
    gc.collect()
    seen["after the tensor is gone"] = len(group._plans)
    seen["only other's"] = list(group._plans._plans) == [id(other)]

    tensor = torch.ones(100)
    group.all_reduce(tensor, algo="ring")
    tensor.set_(torch.full((100,), 2.0))  # new memory under the same tensor
    group.all_reduce(tensor, algo="ring")
    seen["sum after set_"] = int(tensor[0].item())
    seen["plans made"] = group._plans.made

    group.all_reduce(tensor, algo="hd")  # another algorithm: another plan
    seen["plans made after hd"] = group._plans.made
    group.all_reduce(tensor, op="max", algo="hd")  # another reduction: another plan
    seen["plans made after max"] = group._plans.made

    strided = torch.ones(100, 2)[:, 0]  # not contiguous: reduced through a copy, never planned
    for _ in range(2):
        group.all_reduce(strided, algo="ring")
    seen["strided sum"] = int(strided.sum().item())
    for algo in ("tree", "direct"):  # fold outside their messages: not replayable
        group.all_reduce(torch.ones(100), algo=algo)
    seen["plans made at the end"] = group._plans.made
    return seen


def test_a_plan_lives_as_long_as_its_tensor_and_fits_only_its_memory_algorithm_and_op():
    seen = paratrain.run(plan_lifetimes, 2, timeout=RUN_TIMEOUT_S)[0]
    assert seen == {
        "kept": 1, "after the tensor is gone": 1, "only other's": True,
        "sum after set_": 4, "plans made": 4,  # the first tensor, other, the third, the third after set_
        "plans made after hd": 5, "plans made after max": 6,
        "strided sum": 400, "plans made at the end": 6,
    }


def test_plans_are_bounded_oldest_first():
    from paratrain.comm.plans import CallPlans

    def body(group):
        group._plans = CallPlans(capacity=3)
        tensors = [torch.ones(10) for _ in range(5)]
        for tensor in tensors:
            group.all_reduce(tensor, algo="ring")
        return len(group._plans), [id(t) in group._plans._plans for t in tensors]

    assert paratrain.run(body, 2, timeout=RUN_TIMEOUT_S)[0] == (3, [False, False, True, True, True])


def test_an_algorithm_posting_its_own_messages_cannot_be_recorded():
    from paratrain.comm.transport.fabric import Fabric

    link = Link(Fabric(1).endpoint(0), "all_reduce", 1, 0, 1.0, 1 << 20)
    link.program = []
    with pytest.raises(RuntimeError, match="cannot be replayed"):
        link.start([])

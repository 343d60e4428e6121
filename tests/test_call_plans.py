"""Call plans (comm/plans.py): the second all-reduce on a tensor records its messages, every
later one replays them. A replay must give what a fresh call gives, build nothing, and never
outlive or outguess its tensor."""

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
    """The second call records the plan; the algorithm never runs again; every sum is exact.
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
    """gloo compiles a plan (TorchTransport.compile): ring and hd, one segment and many, sum,
    max and avg, a complex tensor (it travels as real pairs): every replayed sum exact."""
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
        plan = g._plans.planned.get(id(tensor))
        if plan is None or plan.compiled is None:
            wrong.append(f"rank {g.rank} {algo} {op} {dtype}: no compiled plan")
    return wrong


@pytest.mark.parametrize("world_size", [2, 3])
def test_compiled_replays_on_gloo_processes(world_size):
    results = paratrain.run(compiled_replays, world_size, launcher="processes", timeout=RUN_TIMEOUT_S)
    assert results == {rank: [] for rank in range(world_size)}


def plan_lifetimes(group: Group) -> dict[str, object]:
    seen = {}
    tensor = torch.ones(100)
    group.all_reduce(tensor, algo="ring")
    seen["noted, not planned, after one call"] = (len(group._plans.noted), len(group._plans.planned))
    group.all_reduce(tensor, algo="ring")
    seen["planned after two"] = (len(group._plans.noted), len(group._plans.planned))
    del tensor
    other = torch.ones(100)
    for _ in range(2):  # the group keeps the works of the last two calls, which refer to it
        group.all_reduce(other, algo="ring")
    gc.collect()
    seen["only other's plan once the tensor is gone"] = list(group._plans.planned) == [id(other)]

    tensor = torch.ones(100)
    for _ in range(2):
        group.all_reduce(tensor, algo="ring")
    made = group._plans.made
    tensor.set_(torch.full((100,), 2.0))  # new memory under the same tensor
    for _ in range(2):
        group.all_reduce(tensor, algo="ring")
    seen["sum after set_"] = int(tensor[0].item())
    seen["new memory, new plan"] = group._plans.made - made

    for algo, op in (("hd", "sum"), ("hd", "max")):  # another algorithm, another reduction: new plans
        for _ in range(2):
            group.all_reduce(tensor, op=op, algo=algo)
    seen["plans made for hd and max"] = group._plans.made - made - 1

    made = group._plans.made
    strided = torch.ones(100, 2)[:, 0]  # not contiguous: reduced through a copy, never planned
    for _ in range(3):
        group.all_reduce(strided, algo="ring")
    seen["strided sum"] = int(strided.sum().item())
    kept = torch.ones(100)
    for algo in ("tree", "direct"):  # they fold outside their messages: never replayed
        for _ in range(3):
            group.all_reduce(kept, algo=algo)
    seen["plans made for strided, tree and direct"] = group._plans.made - made
    return seen


def test_a_plan_lives_as_long_as_its_tensor_and_fits_only_its_memory_algorithm_and_op():
    seen = paratrain.run(plan_lifetimes, 2, timeout=RUN_TIMEOUT_S)[0]
    assert seen == {
        "noted, not planned, after one call": (1, 0), "planned after two": (0, 1),
        "only other's plan once the tensor is gone": True,
        "sum after set_": 8, "new memory, new plan": 1,
        "plans made for hd and max": 2,
        "strided sum": 800, "plans made for strided, tree and direct": 0,
    }


def test_fresh_tensors_never_push_out_the_plans_of_tensors_that_come_back():
    from paratrain.comm.plans import CallPlans

    def body(group):
        group._plans = CallPlans(capacity=3)
        bucket = torch.ones(10)
        for _ in range(2):
            group.all_reduce(bucket, algo="ring")
        fresh = [torch.ones(10) for _ in range(5)]
        for tensor in fresh:
            group.all_reduce(tensor, algo="ring")
        return list(group._plans.planned) == [id(bucket)], [id(t) in group._plans.noted for t in fresh]

    assert paratrain.run(body, 2, timeout=RUN_TIMEOUT_S)[0] == (True, [False, False, True, True, True])


def test_an_algorithm_posting_its_own_messages_cannot_be_recorded():
    from paratrain.comm.transport.fabric import Fabric

    link = Link(Fabric(1).endpoint(0), "all_reduce", 1, 0, 1.0, 1 << 20)
    link.schedule = []
    with pytest.raises(RuntimeError, match="cannot be replayed"):
        link.start([])

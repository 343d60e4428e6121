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
from paratrain.comm.choice import AlgorithmTable, Choice
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
    max and avg, a complex tensor (it travels as real pairs): every replayed sum exact. Where
    the messages go through shared memory the plans replay through Link, never compiled."""
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
        if plan is None or (plan.compiled is None) != (g.kind == "shm"):
            wrong.append(f"rank {g.rank} {algo} {op} {dtype}: {plan and plan.compiled} plan on {g.kind}")
    return wrong


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("shared_memory", ["0", "1"])
def test_compiled_replays_on_gloo_processes(world_size, shared_memory, monkeypatch):
    monkeypatch.setenv("PARATRAIN_SHM", shared_memory)
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


def straight_calls(group: Group) -> dict[str, object]:
    """Which calls go straight to their tensor's plan (Group._run_straight) and which take the whole
    path (Group._run), and that both give exact sums and true flight records."""
    taken = []
    whole_path = group._run

    def counted_run(*args, **kwargs):
        taken.append(args[0])
        return whole_path(*args, **kwargs)

    group._run = counted_run
    seen = {}

    def calls_on(tensor, op="sum", algo="ring", calls=3, **kwargs) -> tuple[int, bool]:
        """Whole-path calls among `calls`, and whether every result was exact."""
        before, exact = len(taken), True
        for call in range(calls):
            inputs = [values(r, call, tensor.numel()).view(tensor.shape) for r in range(group.size)]
            tensor.copy_(inputs[group.rank])
            result = group.all_reduce(tensor, op=op, algo=algo, **kwargs)
            if kwargs.get("async_op"):
                result.wait()
            want = sum(inputs) / (group.size if op == "avg" else 1)
            exact = exact and torch.equal(tensor, want)
        return len(taken) - before, exact

    tensor = torch.empty(8, 16, dtype=torch.float64)
    seen["recording calls"] = calls_on(tensor, calls=2)
    seen["planned calls"] = calls_on(tensor)
    last = group._recorder.calls[-1]
    seen["record"] = (last.op, last.algo, last.tensor.shape, last.tensor.reduce_op, last.seq == group._collective_seq,
                      last.state)
    seen["avg on a plan recorded by sum"] = calls_on(tensor, op="avg")
    averaged = torch.empty(100, dtype=torch.float64)
    calls_on(averaged, op="avg", calls=2)
    seen["avg on its own plan"] = calls_on(averaged, op="avg")
    tensor.resize_(16, 8)  # the same memory under another shape: recorded as it is now
    seen["reshaped"] = calls_on(tensor, calls=1)
    seen["reshaped record"] = group._recorder.calls[-1].tensor.shape
    seen["async"] = calls_on(tensor, calls=1, async_op=True)
    try:
        group.all_reduce(tensor, op="prod", algo="ring")
    except ValueError as error:
        seen["prod"] = str(error)
    try:
        group.all_reduce(tensor, algo="fastest")
    except ValueError as error:
        seen["unknown algorithm"] = str(error).split(";")[0]
    return seen


@pytest.mark.parametrize("launcher", ["threads", "processes"])  # replayed through Link; compiled for gloo
def test_a_call_on_a_planned_tensor_goes_straight_to_its_plan(launcher):
    results = run_on_two_ranks(straight_calls, launcher)
    for rank in range(2):
        assert results[rank] == {
            "recording calls": (2, True), "planned calls": (0, True),
            "record": ("all_reduce", "ring", (8, 16), "sum", True, "completed"),
            "avg on a plan recorded by sum": (3, True),  # replayed, through the whole path
            "avg on its own plan": (0, True),
            "reshaped": (1, True), "reshaped record": (16, 8),
            "async": (1, True),  # a communication thread's call takes the whole path, in order
            "prod": "unknown reduce op 'prod'; valid ops: sum, avg, max, min",
            "unknown algorithm": "all_reduce: unknown algorithm 'fastest'",
        }, rank


def auto_and_debug_calls(group: Group) -> list[tuple[int, bool]]:
    nbytes = 64 * 8
    table = AlgorithmTable()
    table.record(group.kind, group.size, "all_reduce", nbytes, "ring")
    planned = Group(group.transport, timeout=group.timeout, table=table)
    debugged = Group(group.transport, timeout=group.timeout, table=table, debug=True)
    seen, tensors = [], {}
    for g in (planned, debugged):
        whole = []
        whole_path = g._run
        g._run = lambda *args, whole=whole, whole_path=whole_path, **kwargs: whole.append(1) or whole_path(*args, **kwargs)
        tensor = tensors[g] = torch.ones(64, dtype=torch.float64)
        for _ in range(4):
            g.all_reduce(tensor)  # auto: the table says ring
        seen.append((len(whole), torch.equal(tensor, torch.full((64,), float(g.size ** 4), dtype=torch.float64))))
    table.record(group.kind, group.size, "all_reduce", nbytes, "native")  # auto now picks native: the plan is ring's
    tensor = tensors[planned]
    planned.all_reduce(tensor)
    seen.append((planned._recorder.calls[-1].algo, torch.equal(tensor, torch.full((64,), float(group.size ** 5),
                                                                              dtype=torch.float64))))
    return seen


def swapped_table_calls(group: Group) -> list[str]:
    """A plan made while one table said ring is not run once another table (with as many
    records, so the same version number) says native."""
    nbytes = 64 * 8
    ring, native = AlgorithmTable(), AlgorithmTable()
    ring.record(group.kind, group.size, "all_reduce", nbytes, "ring")
    native.record(group.kind, group.size, "all_reduce", nbytes, "native")
    g = Group(group.transport, timeout=group.timeout, table=ring)
    tensor = torch.ones(64, dtype=torch.float64)
    ran = []
    for table in (ring, ring, ring, ring, native, ring):
        g.table = table
        g.all_reduce(tensor)
        ran.append(g._recorder.calls[-1].algo)
    return ran


def test_a_group_given_another_table_resolves_auto_by_it():
    assert paratrain.run(swapped_table_calls, 2)[0] == ["ring"] * 4 + ["native", "ring"]


@pytest.mark.parametrize("launcher", ["threads", "processes"])
def test_auto_calls_go_straight_to_the_plan_of_the_algorithm_auto_picks_and_debug_calls_never_do(launcher):
    results = run_on_two_ranks(auto_and_debug_calls, launcher)
    assert results[0] == [(2, True), (4, True), ("native", True)]
    assert results[1] == results[0]


def test_a_recorded_choice_replaces_the_one_auto_remembered():
    table = AlgorithmTable()
    assert table.choose("all_reduce", 4096, 2, "gloo").algo == "native"  # not measured: the default
    table.record("gloo", 2, "all_reduce", 4096, "hd", "faster by 30%")
    assert table.choose("all_reduce", 4096, 2, "gloo") == Choice("hd", "faster by 30%; measured at 4 KiB on gloo x2")


def shared_segment_plans(group: Group) -> list:
    """oneshot and twoshot plans: calls after the second go straight to the algorithm, and an
    async call on a planned tensor (the communication thread takes the whole path) runs it too."""
    seen = []
    for algo in ("oneshot", "twoshot"):
        group = Group(group.transport, timeout=group.timeout)  # no communication thread yet
        whole = []
        whole_path = group._run
        group._run = lambda *args, whole=whole, **kwargs: whole.append(1) or whole_path(*args, **kwargs)
        tensor = torch.ones(100, dtype=torch.float64)
        for _ in range(4):
            group.all_reduce(tensor, algo=algo)
        group.all_reduce(tensor, algo=algo, async_op=True).wait()
        group.all_reduce(tensor, algo=algo, async_op=True).wait()
        group.close()
        seen.append((algo, len(whole), torch.equal(tensor, torch.full((100,), float(group.size ** 6), dtype=torch.float64))))
    return seen


def test_shared_segment_calls_go_straight_to_their_plan_and_async_calls_run_it_too():
    results = run_on_two_ranks(shared_segment_plans, "processes")
    assert results[0] == results[1] == [("oneshot", 4, True), ("twoshot", 4, True)]  # 2 recording + 2 async


def repeated_scatters_and_gathers(group: Group) -> dict:
    """A reduce-scatter and an all-gather made again on the same tensors: the first two take the
    whole path, the rest go straight, all with the right values; other tensors, or the same
    tensor with new memory, take the whole path again; an entry goes with its tensor."""
    whole = []
    whole_path = group._run
    group._run = lambda *args, **kwargs: whole.append(args[0]) or whole_path(*args, **kwargs)
    n, me = group.size, group.rank
    full, part = torch.empty(4 * n), torch.empty(4)
    exact = True
    for step in range(5):
        full.copy_(torch.arange(4 * n, dtype=torch.float32) * (me + 1) + step)
        group.reduce_scatter(part, full, op="avg")
        want = (torch.arange(4 * me, 4 * me + 4, dtype=torch.float32) * sum(range(1, n + 1)) + n * step) / n
        exact = exact and torch.allclose(part, want)
        part.fill_(float(me + step))
        group.all_gather(full, part)
        exact = exact and torch.equal(full, torch.cat([torch.full((4,), float(r + step)) for r in range(n)]))
    seen = {"whole path": list(whole), "exact": exact, "entries": len(group._repeats.calls)}
    whole.clear()
    full.set_(torch.empty(4 * n).untyped_storage())  # the same tensor, new memory
    group.all_gather(full, part)
    seen["new memory"] = list(whole)
    del full
    seen["entries after a tensor went"] = len(group._repeats.calls)
    group._run = whole_path
    return seen


@pytest.mark.parametrize("launcher", ["threads", "processes"])
def test_repeated_reduce_scatters_and_all_gathers_go_straight(launcher):
    results = run_on_two_ranks(repeated_scatters_and_gathers, launcher)
    for rank in range(2):
        assert results[rank] == {
            "whole path": ["reduce_scatter", "all_gather"] * 2, "exact": True, "entries": 2,
            "new memory": ["all_gather"], "entries after a tensor went": 0,  # both held `full`
        }, rank


def uneven_repeats(group: Group) -> bool:
    """Repeated calls on parts of unequal sizes (3 ranks, 3n+2 elements), in place too: the
    planned one-shot reduce-scatter and all-gather match the reference every time."""
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
    return exact and len(group._repeats.calls) == 2  # both went straight after their second call


def test_repeated_calls_on_uneven_parts_and_in_place_match_the_reference():
    assert paratrain.run(uneven_repeats, 3, launcher="processes", timeout=RUN_TIMEOUT_S) == {0: True, 1: True, 2: True}


# ---- one launch of two processes for the checks above that run on them -------------------------

ON_TWO_PROCESSES = (straight_calls, auto_and_debug_calls, shared_segment_plans, repeated_scatters_and_gathers)
_two_processes_saw: dict[int, dict] = {}  # that launch's results, kept for the tests that read them


def every_check_on_two_processes(group: Group) -> dict[str, object]:
    """Each check of ON_TWO_PROCESSES, each on a group of its own (they replace its _run and
    fill its plans), in one launch: a launch costs more than all four checks."""
    return {check.__name__: check(Group(group.transport, timeout=group.timeout, table=group.table))
            for check in ON_TWO_PROCESSES}


def run_on_two_ranks(check, launcher: str) -> dict[int, object]:
    """check(group) on 2 ranks: on threads, a run of its own; on processes, its part of the one
    launch that runs every check of ON_TWO_PROCESSES (made by the first test that asks)."""
    if launcher == "threads":
        return paratrain.run(check, 2, timeout=RUN_TIMEOUT_S)
    if not _two_processes_saw:
        _two_processes_saw.update(paratrain.run(every_check_on_two_processes, 2, launcher="processes",
                                                timeout=RUN_TIMEOUT_S))
    return {rank: seen[check.__name__] for rank, seen in _two_processes_saw.items()}

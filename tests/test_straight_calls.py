"""Which collective calls run straight from a replay (comm/replays.py, CollectiveCalls.run_straight)
and which take the whole path (Group._run): a call made again on the same tensors with the same
algorithm goes straight; auto goes straight only to the replay of the algorithm the table picks
now; debug and async calls never do. Counted through Group.straight_calls; every result exact."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.comm import Group
from paratrain.comm.choice import AlgorithmTable, Choice

RUN_TIMEOUT_S = 60.0


def values(rank: int, call: int, count: int) -> torch.Tensor:
    """Rank `rank`'s input for call `call`: different on every rank and every call."""
    return torch.arange(count, dtype=torch.float64).mul_(rank + 1).add_(call * 7 + rank)


def whole_path(group: Group, call) -> bool:
    """Make `call()`; whether it took the whole path (it did not run straight from a replay)."""
    before = group.straight_calls
    call()
    return group.straight_calls == before


def straight_calls(group: Group) -> dict[str, object]:
    """Which all-reduces go straight to their tensor's replay and which take the whole path, and
    that both give exact sums and true flight records."""
    seen = {}

    def calls_on(tensor, op="sum", algo="ring", calls=3, **kwargs) -> tuple[int, bool]:
        """Whole-path calls among `calls`, and whether every result was exact."""
        straight_before, exact = group.straight_calls, True
        for call in range(calls):
            inputs = [values(r, call, tensor.numel()).view(tensor.shape) for r in range(group.size)]
            tensor.copy_(inputs[group.rank])
            result = group.all_reduce(tensor, op=op, algo=algo, **kwargs)
            if kwargs.get("async_op"):
                result.wait()
            want = sum(inputs) / (group.size if op == "avg" else 1)
            exact = exact and torch.equal(tensor, want)
        return calls - (group.straight_calls - straight_before), exact

    tensor = torch.empty(8, 16, dtype=torch.float64)
    seen["recording calls"] = calls_on(tensor, calls=2)
    seen["replayed calls"] = calls_on(tensor)
    last = group._recorder.calls[-1]
    seen["record"] = (last.op, last.algo, last.tensor.shape, last.tensor.reduce_op, last.seq == group._calls.seq,
                      last.state)
    seen["avg on a replay recorded by sum"] = calls_on(tensor, op="avg")
    averaged = torch.empty(100, dtype=torch.float64)
    calls_on(averaged, op="avg", calls=2)
    seen["avg on its own replay"] = calls_on(averaged, op="avg")
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
def test_a_call_on_a_replayed_tensor_goes_straight_to_its_replay(launcher):
    results = run_on_two_ranks(straight_calls, launcher)
    for rank in range(2):
        assert results[rank] == {
            "recording calls": (2, True), "replayed calls": (0, True),
            "record": ("all_reduce", "ring", (8, 16), "sum", True, "completed"),
            "avg on a replay recorded by sum": (3, True),  # replayed, through the whole path
            "avg on its own replay": (0, True),
            "reshaped": (1, True), "reshaped record": (16, 8),
            "async": (1, True),  # a communication thread's call takes the whole path, in order
            "prod": "unknown reduce op 'prod'; valid ops: sum, avg, max, min",
            "unknown algorithm": "all_reduce: unknown algorithm 'fastest'",
        }, rank


def auto_and_debug_calls(group: Group) -> list[tuple[int, bool]]:
    nbytes = 64 * 8
    table = AlgorithmTable()
    table.record(group.kind, group.size, "all_reduce", nbytes, "ring")
    replayed = Group(group.transport, timeout=group.timeout, table=table)
    debugged = Group(group.transport, timeout=group.timeout, table=table, debug=True)
    seen, tensors = [], {}
    for g in (replayed, debugged):
        tensor = tensors[g] = torch.ones(64, dtype=torch.float64)
        whole = sum(whole_path(g, lambda: g.all_reduce(tensor)) for _ in range(4))  # auto: the table says ring
        seen.append((whole, torch.equal(tensor, torch.full((64,), float(g.size ** 4), dtype=torch.float64))))
    table.record(group.kind, group.size, "all_reduce", nbytes, "native")  # auto now picks native: the replay is ring's
    tensor = tensors[replayed]
    replayed.all_reduce(tensor)
    seen.append((replayed._recorder.calls[-1].algo, torch.equal(tensor, torch.full((64,), float(group.size ** 5),
                                                                              dtype=torch.float64))))
    return seen


def swapped_table_calls(group: Group) -> list[str]:
    """A replay recorded while one table said ring is not run once another table (with as many
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
def test_auto_calls_go_straight_to_the_replay_of_the_algorithm_auto_picks_and_debug_calls_never_do(launcher):
    results = run_on_two_ranks(auto_and_debug_calls, launcher)
    assert results[0] == [(2, True), (4, True), ("native", True)]
    assert results[1] == results[0]


def test_a_recorded_choice_replaces_the_one_auto_remembered():
    table = AlgorithmTable()
    assert table.choose("all_reduce", 4096, 2, "gloo").algo == "native"  # not measured: the default
    table.record("gloo", 2, "all_reduce", 4096, "hd", "faster by 30%")
    assert table.choose("all_reduce", 4096, 2, "gloo") == Choice("hd", "faster by 30%; measured at 4 KiB on gloo x2")


def shared_segment_replays(group: Group) -> list:
    """oneshot and twoshot replays: calls after the second go straight to the algorithm, and an
    async call on a replayed tensor (the communication thread takes the whole path) runs it too."""
    seen = []
    for algo in ("oneshot", "twoshot"):
        group = Group(group.transport, timeout=group.timeout)  # no communication thread yet
        tensor = torch.ones(100, dtype=torch.float64)
        for _ in range(4):
            group.all_reduce(tensor, algo=algo)
        group.all_reduce(tensor, algo=algo, async_op=True).wait()
        group.all_reduce(tensor, algo=algo, async_op=True).wait()
        group.close()
        seen.append((algo, 6 - group.straight_calls, torch.equal(tensor, torch.full((100,), float(group.size ** 6), dtype=torch.float64))))
    return seen


def test_shared_segment_calls_go_straight_to_their_replay_and_async_calls_run_it_too():
    results = run_on_two_ranks(shared_segment_replays, "processes")
    assert results[0] == results[1] == [("oneshot", 4, True), ("twoshot", 4, True)]  # 2 recording + 2 async


def repeated_scatters_and_gathers(group: Group) -> dict:
    """A reduce-scatter, an all-gather and an all-to-all made again on the same tensors: the first two take the
    whole path, the rest go straight, all with the right values; other tensors, or the same
    tensor with new memory, take the whole path again; an entry goes with its tensor."""
    whole = []
    n, me = group.size, group.rank
    full, part, swapped = torch.empty(4 * n), torch.empty(4), torch.empty(4 * n)
    exact = True
    for step in range(5):
        full.copy_(torch.arange(4 * n, dtype=torch.float32) * (me + 1) + step)
        if whole_path(group, lambda: group.reduce_scatter(part, full, op="avg")):
            whole.append("reduce_scatter")
        want = (torch.arange(4 * me, 4 * me + 4, dtype=torch.float32) * sum(range(1, n + 1)) + n * step) / n
        exact = exact and torch.allclose(part, want)
        part.fill_(float(me + step))
        if whole_path(group, lambda: group.all_gather(full, part)):
            whole.append("all_gather")
        exact = exact and torch.equal(full, torch.cat([torch.full((4,), float(r + step)) for r in range(n)]))
        if whole_path(group, lambda: group.all_to_all(swapped, full)):  # part j of rank i's full to rank j
            whole.append("all_to_all")
        exact = exact and torch.equal(swapped, torch.full((4 * n,), float(me + step)))
    made = group.replays.repeats.made
    for step in range(6):  # fresh outputs every call, as a layer's activations: no entry is worked out
        fresh = torch.empty(4 * n)
        group.all_gather(fresh, part)
        group.all_to_all(torch.empty(4 * n), full)
        exact = exact and torch.equal(fresh, torch.cat([torch.full((4,), float(r + 4)) for r in range(n)]))
    seen = {"whole path": whole, "exact": exact, "entries": group.replays.held().repeats,
            "made for fresh tensors": group.replays.repeats.made - made}
    full.set_(torch.empty(4 * n).untyped_storage())  # the same tensor, new memory
    seen["new memory takes the whole path"] = whole_path(group, lambda: group.all_gather(full, part))
    del full
    seen["entries after a tensor went"] = group.replays.held().repeats
    return seen


@pytest.mark.parametrize("launcher", ["threads", "processes"])
def test_repeated_reduce_scatters_and_all_gathers_go_straight(launcher):
    results = run_on_two_ranks(repeated_scatters_and_gathers, launcher)
    for rank in range(2):
        assert results[rank] == {
            "whole path": ["reduce_scatter", "all_gather", "all_to_all"] * 2, "exact": True, "entries": 3,
            "made for fresh tensors": 0,
            "new memory takes the whole path": True, "entries after a tensor went": 0,  # all held `full`
        }, rank


# ---- one launch of two processes for the checks above that run on them -------------------------

ON_TWO_PROCESSES = (straight_calls, auto_and_debug_calls, shared_segment_replays, repeated_scatters_and_gathers)
_two_processes_saw: dict[int, dict] = {}  # that launch's results, kept for the tests that read them


def every_check_on_two_processes(group: Group) -> dict[str, object]:
    """Each check of ON_TWO_PROCESSES, each on a group of its own (they count its straight calls
    and fill its replays), in one launch: a launch costs more than all four checks."""
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

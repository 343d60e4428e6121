"""all_to_all with split sizes (uneven parts, as mixture-of-experts routing makes them): every
algorithm that takes them gives what gloo's own all_to_all_single gives for the same splits, on
2, 3 and 4 ranks, empty parts included; the bad arguments are refused in one line; the debug
check lets ranks pass different row counts; the autograd function's backward is the all-to-all
with the splits swapped.

The property test runs inside a launched world: rank 0 runs the Hypothesis test and broadcasts
each case it draws (split matrix, dtype, row shape, seed); every rank builds its input from the
case, runs gloo's all_to_all_single (the reference: a real gloo group, among the threads on the
fabric) and each algorithm, and the ranks sum their wrong results to rank 0, whose assertion
Hypothesis sees, so it shrinks a failure found on any rank. One launch serves many examples.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paratrain
from paratrain.bench import collectives_cli
from paratrain.cli import main
from paratrain.comm import CollectiveMismatchError, Group
from paratrain.comm.transport.fabric import Fabric
from paratrain.parallel.expert.ep_comms import all_to_all_rows
from paratrain.parallel.tensor.tp_comms import copy_to_parallel, gather_from_parallel
from all_to_all_cases import (DTYPES, ROW_SHAPES, SENTINEL, equal_parts_made_again, expected_output, larger_than_a_slot,
                              mismatched_splits, rank_input, uneven_parts_made_again, where_one_rank_may_not_read)

RUN_TIMEOUT_S = 60.0
ON_EVERY_TRANSPORT = ("direct", "native", "auto")
ON_SHARED_MEMORY = ("oneshot",)


# ---- one case: every rank's input, gloo's result, each algorithm's -----------------------------


def _check_case(group, case, algos) -> dict[str, int]:
    """Run gloo's all_to_all_single and every algorithm on `case`; per algorithm (and for gloo
    against the inputs), how many ranks got a wrong result, summed over the group."""
    matrix = case[3]
    inp = rank_input(case, group.rank)
    send = matrix[group.rank]
    receive = [row[group.rank] for row in matrix]
    expected = expected_output(case, group.rank)
    pg = group.transport.torch_process_group(group.timeout)
    reference = torch.full_like(expected, SENTINEL)
    pg.alltoall_base(reference, inp, receive, send, dist.AllToAllOptions()).wait()
    wrong = [not torch.equal(reference, expected)]
    for algo, async_op in algos:
        out = torch.full_like(expected, SENTINEL)
        handle = group.all_to_all(out, inp, algo=algo, async_op=async_op,
                                  output_split_sizes=receive, input_split_sizes=send)
        if async_op:
            handle.wait()
        wrong.append(not torch.equal(out, reference))
    counts = torch.tensor(wrong, dtype=torch.int64)
    group.all_reduce(counts, algo="native")
    names = ["gloo vs the inputs"] + [f"{algo}{' async' if async_op else ''}" for algo, async_op in algos]
    return {name: count for name, count in zip(names, counts.tolist()) if count}


def _cases(n: int):
    part = st.one_of(st.just(0), st.integers(0, 6))  # empty parts half the time
    matrix = st.lists(st.lists(part, min_size=n, max_size=n), min_size=n, max_size=n)
    return st.tuples(st.integers(0, len(DTYPES) - 1), st.integers(0, len(ROW_SHAPES) - 1),
                     st.integers(0, 2**16), matrix)


# ---- a case from rank 0 to every rank -----------------------------------------------------------


def _send_case(group, case) -> None:
    """Broadcast `case` (None: the property is done) as one tensor of fixed length."""
    n = group.size
    code = torch.zeros(4 + n * n, dtype=torch.int64)
    if case is not None:
        code[:4] = torch.tensor([1, case[0], case[1], case[2]])
        code[4:] = torch.tensor(case[3]).view(-1)
    group.broadcast(code, 0, algo="native")


def _receive_case(group):
    n = group.size
    code = torch.zeros(4 + n * n, dtype=torch.int64)
    group.broadcast(code, 0, algo="native")
    if code[0] == 0:
        return None
    return int(code[1]), int(code[2]), int(code[3]), code[4:].view(n, n).tolist()


def property_in_world(group, max_examples: int) -> int:
    """Rank 0 runs the Hypothesis test, sending each case it draws; the others follow until it
    says it is done. Returns how many cases this rank ran."""
    algos = [(algo, False) for algo in ON_EVERY_TRANSPORT + (ON_SHARED_MEMORY if group.kind == "shm" else ())]
    algos.append(("auto", True))
    ran = 0
    if group.rank != 0:
        while (case := _receive_case(group)) is not None:
            _check_case(group, case, algos)
            ran += 1
        return ran

    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=_cases(group.size))
    def every_algorithm_gives_glooss_result(case):
        nonlocal ran
        _send_case(group, case)
        ran += 1
        wrong = _check_case(group, case, algos)
        assert not wrong, f"ranks with a wrong result, per algorithm: {wrong}"

    try:
        every_algorithm_gives_glooss_result()
    finally:
        _send_case(group, None)
    return ran


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_algorithm_matches_gloo_for_random_splits_with_empty_parts_on_threads(world_size):
    results = paratrain.run(property_in_world, world_size, args=(60,), timeout=RUN_TIMEOUT_S)
    assert len(set(results.values())) == 1 and results[0] >= 30  # every rank ran every case


def _in_subgroups_of_every_size(group) -> dict:
    """Four processes: the property on all 4, then on 3 (the fourth alone: a world of one), then
    on two pairs at once; a part larger than a shared-segment slot; mismatched splits; equal parts
    made again, through the native kernels and (on the pairs) without them."""
    ran = {4: property_in_world(group, 8)}
    trio = group.split([[0, 1, 2], [3]])
    ran[trio.size] = property_in_world(trio, 6)
    pair = group.split([[0, 1], [2, 3]])
    ran[2] = property_in_world(pair, 6)
    kernels, pair.transport.arena.native = pair.transport.arena.native, None  # every rank of the pair alike
    without_kernels = equal_parts_made_again(pair)
    pair.transport.arena.native = kernels
    return {"kind": group.kind, "ran": ran, "pieces": larger_than_a_slot(group, ON_EVERY_TRANSPORT + ON_SHARED_MEMORY),
            "mismatch": mismatched_splits(group), "equal parts again": equal_parts_made_again(group),
            "equal parts again in 3": equal_parts_made_again(trio) if trio.size > 1 else {},
            "equal parts again without kernels": without_kernels,
            "rank 1 may not read": where_one_rank_may_not_read(group),
            "uneven again": uneven_parts_made_again(group)}


def test_every_algorithm_matches_gloo_in_processes_of_one_host_on_2_3_and_4_ranks():
    results = paratrain.run(_in_subgroups_of_every_size, 4, launcher="processes", timeout=RUN_TIMEOUT_S)
    assert {result["kind"] for result in results.values()} == {"shm"}
    assert results[0]["ran"][4] >= 4 and results[0]["ran"][3] >= 3 and results[0]["ran"][2] >= 3
    assert all(not any(result["pieces"].values()) for result in results.values()), results
    for key in ("equal parts again", "equal parts again in 3", "equal parts again without kernels"):
        assert all(not any(result[key].values()) for result in results.values()), results
    assert [results[rank]["uneven again"] for rank in range(4)] == [
        {"wrong": 0, "straight": [2, 4, 4]}] * 2 + [{"wrong": 0, "straight": [2, 2, 2]},
                                                   {"wrong": 0, "straight": [2, 2, 4]}], results
    refused = [results[rank]["rank 1 may not read"] for rank in range(4)]
    assert [seen["wrong"] for seen in refused] == [0] * 4, refused
    assert refused[0]["reads"] is refused[1]["reads"] is False and refused[2]["reads"] is refused[3]["reads"]
    expected = ("all_to_all: rank 0 sends 2 elements to rank 1, which expects 1 from it "
                "(input_split_sizes[1] on rank 0 and output_split_sizes[0] on rank 1 must count the same rows)")
    assert {result["mismatch"] for result in results.values()} == {expected}


def _mismatch_on_the_fabric(group) -> str:
    send = [1, 2] if group.rank == 0 else [1, 1]
    try:
        group.all_to_all(torch.zeros(2, 3), torch.zeros(sum(send), 3), algo="native",
                         output_split_sizes=[1, 1], input_split_sizes=send)
    except ValueError as error:
        return str(error)
    return "no error"


def test_mismatched_splits_raise_the_same_error_on_every_rank_of_the_fabric():
    results = paratrain.run(_mismatch_on_the_fabric, 2, timeout=10)
    assert set(results.values()) == {"all_to_all: rank 0 sends 6 elements to rank 1, which expects 3 from it "
                                     "(input_split_sizes[1] on rank 0 and output_split_sizes[0] on rank 1 "
                                     "must count the same rows)"}


# ---- bad arguments: refused on the calling rank, before anything is sent ------------------------


@pytest.fixture
def rank0_of_two():
    """Rank 0 of a two-rank fabric whose rank 1 never runs: a call not refused up front waits for
    rank 1 and fails with a timeout instead."""
    return Group(Fabric(2).endpoint(0), timeout=2.0)


def _call(out_shape, in_shape, out_splits, in_splits, algo="auto"):
    return lambda group: group.all_to_all(torch.zeros(out_shape), torch.zeros(in_shape), algo=algo,
                                          output_split_sizes=out_splits, input_split_sizes=in_splits)


BAD_SPLITS = {
    "input_splits_do_not_sum_to_the_rows": (
        _call((4, 2), (5, 2), [2, 2], [2, 2]), ValueError,
        "all_to_all: input_split_sizes [2, 2] sum to 4 rows, but 'input' has 5 (its dimension 0)"),
    "output_rows_mismatch": (
        _call((3, 2), (4, 2), [2, 2], [1, 3]), ValueError,
        "all_to_all: output_split_sizes [2, 2] sum to 4 rows, but 'output' has 3 (its dimension 0)"),
    "negative_size": (
        _call((4,), (4,), [2, 2], [5, -1]), ValueError,
        "all_to_all: input_split_sizes [5, -1] holds a negative size"),
    "one_size_too_many": (
        _call((4,), (4,), [2, 2, 0], [2, 2]), ValueError,
        "all_to_all: output_split_sizes has 3 entries, expected 2 (one per rank)"),
    "not_ints": (
        _call((4,), (4,), [2, 2], [2.0, 2.0]), TypeError,
        "all_to_all: input_split_sizes must hold ints, got [2.0, 2.0]"),
    "not_a_list": (
        _call((4,), (4,), [2, 2], 4), TypeError,
        "all_to_all: input_split_sizes must be a list of ints, one per rank, got int"),
    "rows_of_different_shapes": (
        _call((4, 3), (4, 2), [2, 2], [2, 2]), ValueError,
        "all_to_all: a row of 'output' has shape [3] and a row of 'input' [2]; they must be the same"),
    "no_dimension_to_split": (
        _call((), (4,), [1, 0], [2, 2]), ValueError,
        "all_to_all: split sizes count rows of dimension 0, and 'output' has no dimensions"),
    "equal_rows_that_do_not_split": (
        _call((4,), (5,), [2, 2], None), ValueError,
        "all_to_all: input_split_sizes left out, so 'input''s 5 rows must split evenly over 2 ranks; "
        "give input_split_sizes"),
    "ring_takes_equal_parts_only": (
        _call((4,), (4,), [2, 2], [1, 3], algo="ring"), ValueError,
        "all_to_all: algorithm 'ring' takes equal parts only; with split sizes, valid: direct, native, auto"),
}


@pytest.mark.parametrize("name", list(BAD_SPLITS))
def test_bad_split_sizes_are_refused_in_one_line(rank0_of_two, name):
    call, error_type, message = BAD_SPLITS[name]
    with pytest.raises(error_type) as caught:
        call(rank0_of_two)
    assert str(caught.value) == message


# ---- the debug check and the even case ------------------------------------------------------


def _rows_per_rank(group, width_of_rank_1: int):
    """Rank r sends r + 1 rows to each rank: different row counts, the same rows unless told."""
    n, width = group.size, width_of_rank_1 if group.rank == 1 else 3
    out = torch.empty(sum(r + 1 for r in range(n)), width)
    group.all_to_all(out, torch.full(((group.rank + 1) * n, width), float(group.rank)),
                     output_split_sizes=[r + 1 for r in range(n)], input_split_sizes=[group.rank + 1] * n)
    return out[:, 0].tolist()


def test_debug_check_lets_row_counts_differ_but_not_row_shapes():
    results = paratrain.run(_rows_per_rank, 3, args=(3,), debug=True, timeout=10)
    assert all(rows == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0] for rows in results.values())
    with pytest.raises(CollectiveMismatchError, match=r"rank 1 called all_to_all\(float32\[\*, 4\]\)"):
        paratrain.run(_rows_per_rank, 3, args=(4,), debug=True, timeout=10)


def _one_side_given(group):
    """Only input_split_sizes given: the output is taken as equal rows, as torch does."""
    out = torch.empty(group.size * 2)
    send = [2] * group.size
    group.all_to_all(out, torch.arange(2.0 * group.size) + 10 * group.rank, input_split_sizes=send)
    return out.tolist()


def test_split_sizes_left_out_on_one_side_mean_equal_rows():
    results = paratrain.run(_one_side_given, 2, timeout=10)
    assert results == {0: [0.0, 1.0, 10.0, 11.0], 1: [2.0, 3.0, 12.0, 13.0]}


# ---- autograd: the backward of a dispatch is a combine ---------------------------------------


def _gradcheck_dispatch(group) -> bool:
    """gradcheck of one function of every rank's input, the same on every rank: each rank holds
    x_all (every rank's rows), takes its own and dispatches them, pads what it got to the
    longest and gathers everyone's. So gradcheck perturbs the same element everywhere and runs
    the same backward everywhere (each one a collective); on the way back, the gather keeps this
    rank's part and copy_to_parallel sums the ranks' gradients of x_all."""
    n, width = group.size, 2
    matrix = [[(2 * i + j) % 3 for j in range(n)] for i in range(n)]  # empty parts included
    starts = [sum(sum(row) for row in matrix[:i]) for i in range(n + 1)]
    receive = [row[group.rank] for row in matrix]
    longest = max(sum(row[j] for row in matrix) for j in range(n))

    def dispatched(x_all):
        mine = copy_to_parallel(x_all, group)[starts[group.rank] : starts[group.rank + 1]]
        out = all_to_all_rows(mine, group, receive, matrix[group.rank])
        padded = torch.cat([out, out.new_zeros(longest - out.shape[0], width)])
        return gather_from_parallel(padded, group, 0, n * longest)

    x_all = torch.randn(starts[-1], width, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    return torch.autograd.gradcheck(dispatched, (x_all.requires_grad_(),))


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_rows_backward_is_the_swapped_all_to_all(world_size):
    results = paratrain.run(_gradcheck_dispatch, world_size, timeout=RUN_TIMEOUT_S)
    assert all(results.values())


# ---- the benchmark ---------------------------------------------------------------------------


def _bench(monkeypatch, *args: str):
    monkeypatch.setattr(collectives_cli, "copy_bandwidth_gbps", lambda device: 12.5)  # not measured here
    return CliRunner().invoke(main, ["bench", "collectives", "--launcher", "threads", "--nproc", "3",
                                     "--warmup", "0", "--iters", "1", *args])


def test_bench_times_uneven_parts_beside_even_ones_and_states_them(tmp_path, monkeypatch):
    path = tmp_path / "out.json"
    result = _bench(monkeypatch, "--ops", "all_to_all", "--splits", "both", "--min-bytes", "4K",
                    "--max-bytes", "4K", "--json", str(path))
    assert result.exit_code == 0, result.output
    assert "ring takes equal parts only: skipped for all_to_all_uneven" in result.output
    records = json.loads(path.read_text())
    even = [r for r in records if r["op"] == "all_to_all"]
    uneven = [r for r in records if r["op"] == "all_to_all_uneven"]
    assert {r["algo"] for r in even} == {"ring", "direct", "native", "auto(native)"}
    assert {r["algo"] for r in uneven} == {"direct", "native", "auto(native)"}
    assert all(r["splits"] == [586, 292, 146] and "2^(n-1-j)" in r["split_rule"] for r in uneven)  # 4/7, 2/7, 1/7
    assert all(r["wrong"] == 0 for r in records)


def test_bench_refuses_splits_without_an_all_to_all_or_with_tuning(monkeypatch):
    result = _bench(monkeypatch, "--ops", "all_reduce", "--splits", "uneven")
    assert result.exit_code == 2 and "splits apply to all_to_all alone: add it to --ops" in result.output
    result = _bench(monkeypatch, "--ops", "all_to_all", "--splits", "both", "--tune")
    assert result.exit_code == 2 and "--splits uneven or both measures; it takes no --tune" in result.output

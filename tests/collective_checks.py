"""The collective checkers: each rank knows every rank's input (collective_cases.py), runs one
collective and writes down every difference from the reference, so a failing sweep lists all the
cases that differed. Shared by the fabric matrix (test_collectives_fabric.py), gloo
(test_collectives_gloo.py), the shared segment (test_shm_arena.py), debug mode
(test_comm_errors.py) and CUDA (test_cuda.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from paratrain.comm import Group
from paratrain.comm.algorithms import algorithms_for

from collective_cases import (
    DTYPES, FLOAT_TOLERANCE, NONCONTIGUOUS_COUNT, REDUCE_OPS, SENTINEL, case_inputs, counts_for, device_of,
    dtype_name, output_buffer, parts, rank_input, reference, roots_for, stored_as,
)


# ---- recording differences -----------------------------------------------------------------


class Report:
    """One rank's list of differences from the reference, one line each."""

    def __init__(self, group: Group):
        self.rank, self.size = group.rank, group.size
        self.failures: list[str] = []

    def fail(self, label: str, problem: str) -> None:
        self.failures.append(f"rank {self.rank}/{self.size} {label}: {problem}")

    def compare(self, label: str, actual: torch.Tensor, expected: torch.Tensor, what="result"):
        problem = difference(actual.reshape(-1).cpu(), expected.reshape(-1))
        if problem:
            self.fail(label, f"{what}: {problem}")

    def same_object(self, label: str, returned, tensor: torch.Tensor) -> None:
        if returned is not tensor:
            self.fail(label, f"returned {type(returned).__name__}, not the tensor it wrote into")

    def gaps_untouched(self, label: str, gaps: torch.Tensor | None) -> None:
        if gaps is not None and not bool((gaps == SENTINEL[gaps.is_floating_point()]).all()):
            self.fail(label, "wrote into the elements between a strided view's elements")


def difference(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    if actual.shape != expected.shape:
        return f"{actual.numel()} elements, expected {expected.numel()}"
    if torch.equal(actual, expected):  # most results are exact: no need to look closer
        return None
    if actual.is_floating_point():
        rtol, atol = FLOAT_TOLERANCE[actual.dtype]
        close = torch.isclose(actual.double(), expected.double(), rtol=rtol, atol=atol)
    else:
        close = actual == expected
    if bool(close.all()):
        return None
    wrong = (~close).nonzero().flatten()
    first = int(wrong[0])
    return (
        f"{wrong.numel()} of {actual.numel()} elements differ; first at [{first}]: "
        f"got {actual[first].item()}, expected {expected[first].item()}"
    )


@contextmanager
def checking(label: str):
    """Name the case in any error a collective raises (the run stops at the first one)."""
    try:
        yield
    except Exception as error:
        error.add_note(f"while checking {label}")
        raise


# ---- one check per op ----------------------------------------------------------------------


def check_all_reduce(group, report, algo, dtype, count, op, layout="contiguous"):
    label = f"all_reduce(algo={algo}, {dtype_name(dtype)}, count={count}, op={op}, {layout})"
    inputs = case_inputs(group.size, count, dtype, "all_reduce")
    tensor, gaps = stored_as(inputs[group.rank], layout, device_of(group))
    with checking(label):
        returned = group.all_reduce(tensor, op=op, algo=algo)
    report.compare(label, tensor, reference(group.size, count, dtype, "all_reduce", op))
    report.same_object(label, returned, tensor)
    report.gaps_untouched(label, gaps)


def check_reduce_scatter(group, report, algo, dtype, count, op, in_layout="contiguous",
                         out_layout="contiguous"):
    label = (f"reduce_scatter(algo={algo}, {dtype_name(dtype)}, count={count}, op={op}, "
             f"input {in_layout}, output {out_layout})")
    inputs = case_inputs(group.size, count, dtype, "reduce_scatter")
    expected = parts(reference(group.size, count, dtype, "reduce_scatter", op), group.size)[group.rank]
    input, _ = stored_as(inputs[group.rank], in_layout, device_of(group))
    output, gaps = output_buffer(expected.numel(), dtype, out_layout, device_of(group))
    with checking(label):
        returned = group.reduce_scatter(output, input, op=op, algo=algo)
    report.compare(label, output, expected)
    report.compare(label, input, inputs[group.rank], what="input was modified")
    report.same_object(label, returned, output)
    report.gaps_untouched(label, gaps)


def check_reduce_scatter_in_place(group, report, algo, dtype, count, op):
    """NCCL's in-place form: the output is this rank's own part of the input."""
    label = f"reduce_scatter in place(algo={algo}, {dtype_name(dtype)}, count={count}, op={op})"
    inputs = case_inputs(group.size, count, dtype, "reduce_scatter in place")
    input = inputs[group.rank].to(device_of(group), copy=True)
    output = parts(input, group.size)[group.rank]
    with checking(label):
        group.reduce_scatter(output, input, op=op, algo=algo)
    expected = reference(group.size, count, dtype, "reduce_scatter in place", op)
    report.compare(label, output, parts(expected, group.size)[group.rank])


def check_all_gather(group, report, algo, dtype, count, in_layout="contiguous",
                     out_layout="contiguous"):
    """`count` is the output's size; rank r contributes part r of it."""
    label = (f"all_gather(algo={algo}, {dtype_name(dtype)}, count={count}, "
             f"input {in_layout}, output {out_layout})")
    sizes = [part.numel() for part in parts(torch.empty(count), group.size)]
    inputs = [rank_input(k, sizes[k], dtype, "all_gather") for k in range(group.size)]
    input, _ = stored_as(inputs[group.rank], in_layout, device_of(group))
    output, gaps = output_buffer(count, dtype, out_layout, device_of(group))
    with checking(label):
        returned = group.all_gather(output, input, algo=algo)
    report.compare(label, output, torch.cat(inputs))
    report.compare(label, input, inputs[group.rank], what="input was modified")
    report.same_object(label, returned, output)
    report.gaps_untouched(label, gaps)


def check_all_gather_in_place(group, report, algo, dtype, count):
    """NCCL's in-place form: the input is this rank's own part of the output."""
    label = f"all_gather in place(algo={algo}, {dtype_name(dtype)}, count={count})"
    sizes = [part.numel() for part in parts(torch.empty(count), group.size)]
    inputs = [rank_input(k, sizes[k], dtype, "all_gather in place") for k in range(group.size)]
    output = torch.full((count,), SENTINEL[dtype.is_floating_point], dtype=dtype, device=device_of(group))
    input = parts(output, group.size)[group.rank]
    input.copy_(inputs[group.rank])
    with checking(label):
        group.all_gather(output, input, algo=algo)
    report.compare(label, output, torch.cat(inputs))


def check_broadcast(group, report, algo, dtype, count, root, layout="contiguous"):
    label = f"broadcast(algo={algo}, {dtype_name(dtype)}, count={count}, root={root}, {layout})"
    inputs = case_inputs(group.size, count, dtype, "broadcast")
    tensor, gaps = stored_as(inputs[group.rank], layout, device_of(group))
    with checking(label):
        returned = group.broadcast(tensor, root=root, algo=algo)
    report.compare(label, tensor, inputs[root])
    report.same_object(label, returned, tensor)
    report.gaps_untouched(label, gaps)


def check_reduce(group, report, algo, dtype, count, root, op, layout="contiguous"):
    label = (f"reduce(algo={algo}, {dtype_name(dtype)}, count={count}, root={root}, op={op}, "
             f"{layout})")
    inputs = case_inputs(group.size, count, dtype, "reduce")
    tensor, gaps = stored_as(inputs[group.rank], layout, device_of(group))
    with checking(label):
        returned = group.reduce(tensor, root=root, op=op, algo=algo)
    if group.rank == root:
        report.compare(label, tensor, reference(group.size, count, dtype, "reduce", op))
    else:
        report.compare(label, tensor, inputs[group.rank], what="non-root tensor changed")
    report.same_object(label, returned, tensor)
    report.gaps_untouched(label, gaps)


def check_all_to_all(group, report, algo, dtype, count, in_layout="contiguous",
                     out_layout="contiguous"):
    """`count` is every rank's input size; part j of each input goes to rank j."""
    label = (f"all_to_all(algo={algo}, {dtype_name(dtype)}, count={count}, "
             f"input {in_layout}, output {out_layout})")
    inputs = case_inputs(group.size, count, dtype, "all_to_all")
    expected = torch.cat([parts(x, group.size)[group.rank] for x in inputs])
    input, _ = stored_as(inputs[group.rank], in_layout, device_of(group))
    output, gaps = output_buffer(expected.numel(), dtype, out_layout, device_of(group))
    with checking(label):
        returned = group.all_to_all(output, input, algo=algo)
    report.compare(label, output, expected)
    report.compare(label, input, inputs[group.rank], what="input was modified")
    report.same_object(label, returned, output)
    report.gaps_untouched(label, gaps)


# ---- sweeps: one op over the whole matrix, on one rank --------------------------------------


def reduce_cases(dtype: torch.dtype, counts, roots=(None,)) -> list[tuple[int, int | None, str]]:
    """(count, root, reduce op) cases for one algorithm: every count (x every root) once, the
    reduce ops taken in turn, so every reduce op and every count (and root) runs, not every
    pairing of them (a pairwise covering, 4x fewer calls). That is enough because the two do
    not interact: the count (and root) picks an algorithm's parts, steps and segments, the reduce
    op only the kernel that combines two buffers (ops.combine; avg is a sum divided once at the
    end, by the Group). The turn starts at the dtype's place in DTYPES, so the matrix's four
    dtypes at one world size together still run every count with every reduce op."""
    pairs = [(count, root) for count in counts for root in roots]
    shift = DTYPES.index(dtype) if dtype in DTYPES else 0
    return [(*pairs[k % len(pairs)], REDUCE_OPS[(k + shift) % len(REDUCE_OPS)])
            for k in range(max(len(pairs), len(REDUCE_OPS)))]


def _sweep_all_reduce(group, report, algos, dtype, counts, roots):
    for algo in algos:
        for count, _, op in reduce_cases(dtype, counts):
            check_all_reduce(group, report, algo, dtype, count, op)
        for layout in ("transposed", "strided"):
            check_all_reduce(group, report, algo, dtype, NONCONTIGUOUS_COUNT, "sum", layout)


def _sweep_reduce_scatter(group, report, algos, dtype, counts, roots):
    for algo in algos:
        for count, _, op in reduce_cases(dtype, counts):
            check_reduce_scatter(group, report, algo, dtype, count, op)
        check_reduce_scatter(group, report, algo, dtype, NONCONTIGUOUS_COUNT, "max",
                             in_layout="transposed", out_layout="strided")
        for op in ("sum", "min"):
            check_reduce_scatter_in_place(group, report, algo, dtype, NONCONTIGUOUS_COUNT, op)


def _sweep_all_gather(group, report, algos, dtype, counts, roots):
    for algo in algos:
        for count in counts:
            check_all_gather(group, report, algo, dtype, count)
        check_all_gather(group, report, algo, dtype, NONCONTIGUOUS_COUNT,
                         in_layout="strided", out_layout="transposed")
        check_all_gather_in_place(group, report, algo, dtype, NONCONTIGUOUS_COUNT)


def _sweep_broadcast(group, report, algos, dtype, counts, roots):
    for algo in algos:
        for count in counts:
            for root in roots:
                check_broadcast(group, report, algo, dtype, count, root)
        for layout in ("transposed", "strided"):
            check_broadcast(group, report, algo, dtype, NONCONTIGUOUS_COUNT, roots[-1], layout)


def _sweep_reduce(group, report, algos, dtype, counts, roots):
    for algo in algos:
        for count, root, op in reduce_cases(dtype, counts, roots):
            check_reduce(group, report, algo, dtype, count, root, op)
        for layout in ("transposed", "strided"):
            check_reduce(group, report, algo, dtype, NONCONTIGUOUS_COUNT, roots[-1], "sum", layout)


def _sweep_all_to_all(group, report, algos, dtype, counts, roots):
    for algo in algos:
        for count in counts:
            check_all_to_all(group, report, algo, dtype, count)
        check_all_to_all(group, report, algo, dtype, NONCONTIGUOUS_COUNT,
                         in_layout="transposed", out_layout="strided")


SWEEPS = {
    "all_reduce": _sweep_all_reduce,
    "reduce_scatter": _sweep_reduce_scatter,
    "all_gather": _sweep_all_gather,
    "broadcast": _sweep_broadcast,
    "reduce": _sweep_reduce,
    "all_to_all": _sweep_all_to_all,
}


def sweep(group: Group, op_name: str, dtypes, counts=None, algos=None) -> list[str]:
    """Run `op_name` over every algorithm (or `algos`), dtype, count, reduce op (in turn:
    reduce_cases), root, non-contiguous layout and in-place form on this rank; return the
    differences found."""
    report = Report(group)
    algos = algos or algorithms_for(op_name, group.kind)
    counts = counts or counts_for(group.size)
    for dtype in dtypes:
        SWEEPS[op_name](group, report, algos, dtype, counts, roots_for(group.size))
    return report.failures


def sweep_with_small_segments(group: Group, op_name: str, dtypes) -> list[str]:
    """The same sweep through a group that cuts every message into 64-byte segments, so the
    pipelined paths (segmented ring steps, chained broadcast/reduce) run on small counts."""
    segmented = Group(group.transport, timeout=group.timeout, segment_bytes=64)
    algos = [a for a in algorithms_for(op_name, group.kind) if a not in ("native", "auto")]
    return sweep(segmented, op_name, dtypes, counts=[1, 2 * group.size + 1, 300], algos=algos)


def assert_no_failures(results: dict[int, list[str]]) -> None:
    failures = [line for rank in sorted(results) for line in results[rank]]
    shown = "\n".join(failures[:40]) + (f"\n... and {len(failures) - 40} more" if len(failures) > 40 else "")
    assert not failures, f"{len(failures)} differences from the reference:\n{shown}"

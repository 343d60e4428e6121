"""The collective checkers: each rank knows every rank's input (a function of the case, made
once per process), runs one collective and writes down every difference from the reference,
so a failing sweep lists all the cases that differed. Shared by the fabric matrix (test_collectives_fabric.py), gloo
(test_collectives_gloo.py), debug mode (test_comm_errors.py) and CUDA (test_cuda.py).
"""

from __future__ import annotations

import functools
import zlib
from contextlib import contextmanager

import torch

from paratrain.comm import Group
from paratrain.comm.algorithms import algorithms_for

WORLD_SIZES = (1, 2, 3, 4, 5, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)
REDUCE_OPS = ("sum", "avg", "max", "min")
RUN_TIMEOUT_S = 60.0  # a hang fails as a CommTimeoutError naming the call, not as a stuck suite

# Float inputs are multiples of 1/8 in [-2, 2]. Every partial sum of up to 8 of them is exact in
# float32, float16 (11 significant bits) and bfloat16 (8 bits), so sum, max and min are exact
# whatever order an algorithm reduces in, and a part dropped or folded in twice cannot hide
# inside a tolerance. What is left is avg's division: the group divides once in the tensor's own
# dtype, the reference in float64 rounded once to that dtype, so the two may differ by the
# rounding of one division, one unit in the last place: 2^-23 (float32), 2^-10 (float16),
# 2^-7 (bfloat16) relative. The tolerances allow twice that; float16/bfloat16 need the looser
# ones because they have so few bits. int64 is compared exactly (avg truncates on both sides).
FLOAT_TOLERANCE = {  # dtype: (rtol, atol)
    torch.float32: (2.4e-7, 1e-7),
    torch.float16: (2e-3, 1e-4),
    torch.bfloat16: (1.6e-2, 1e-3),
}
SENTINEL = {True: 99.0, False: 10**12}  # is_floating_point -> a value no result can take

# 77 elements split unevenly over every world size tested, and viewed as 7 x 11 it can be
# stored transposed, so one count serves every non-contiguous layout.
NONCONTIGUOUS_COUNT, NONCONTIGUOUS_SHAPE = 77, (7, 11)


def counts_for(world_size: int) -> list[int]:
    """Empty, one element, fewer elements than ranks, not divisible by the world size, and a
    few hundred / thousand (20001 float32 is over the fabric's 64 KiB, so `auto` picks ring)."""
    return sorted({0, 1, max(world_size - 1, 1), 2 * world_size + 1, 300, 4099, 20001})


def roots_for(world_size: int) -> list[int]:
    return sorted({0, world_size // 2, world_size - 1})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- inputs and references ---------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def rank_input(rank: int, count: int, dtype: torch.dtype, salt: str) -> torch.Tensor:
    """Rank `rank`'s input for a case, shared and read-only: each check copies its own rank's
    into the tensor it hands the collective (stored_as, copy_), so none is ever written to,
    and the rank threads of one process share them instead of each cloning every rank's."""
    seed = zlib.crc32(f"{rank}/{count}/{dtype}/{salt}".encode())  # same in every process
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randint(-16, 17, (count,), generator=generator) / 8).to(dtype)
    return torch.randint(-10**6, 10**6, (count,), generator=generator, dtype=dtype)


def case_inputs(size: int, count: int, dtype: torch.dtype, salt: str) -> list[torch.Tensor]:
    """Every rank's input for a case of `count` elements a rank (read-only, as rank_input's)."""
    return [rank_input(rank, count, dtype, salt) for rank in range(size)]


def reduced(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of all ranks' inputs, computed exactly: max and min in the inputs' dtype
    (exact in any), sums in float64 or int64. Folded one input at a time, elementwise: a
    stack of them and a reduction over its first dimension cost several times as much on
    messages of a few MiB (test_shm_arena.py)."""
    dtype, n = inputs[0].dtype, len(inputs)
    if op in ("max", "min"):
        extreme = torch.maximum if op == "max" else torch.minimum
        return functools.reduce(extreme, inputs[1:], inputs[0].clone())
    total = torch.zeros(inputs[0].shape, dtype=torch.float64 if dtype.is_floating_point else dtype)
    for x in inputs:
        total += x
    if op == "avg":
        total = total / n if dtype.is_floating_point else torch.div(total, n, rounding_mode="trunc")
    return total.to(dtype)


# The ranks of a threads world check the same case at about the same time (the collective keeps
# them in step), so a small cache lets one of them compute the reference for all; read-only too.
@functools.lru_cache(maxsize=64)
def reference(size: int, count: int, dtype: torch.dtype, salt: str, op: str) -> torch.Tensor:
    """`reduced` of a case's inputs."""
    return reduced(case_inputs(size, count, dtype, salt), op)


def parts(tensor: torch.Tensor, world_size: int) -> tuple[torch.Tensor, ...]:
    """torch.tensor_split's parts: the rule the collectives document for uneven counts."""
    return torch.tensor_split(tensor, world_size)


def stored_as(values: torch.Tensor, layout: str, device="cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """A tensor on `device` whose logical (row-major) contents are `values`, stored as `layout`
    says, and for "strided" the skipped elements in between (the sentinel, to be checked)."""
    count, dtype = values.numel(), values.dtype
    if layout == "contiguous":
        return values.to(device, copy=True), None
    if layout == "transposed":
        rows, cols = NONCONTIGUOUS_SHAPE
        tensor = torch.empty(cols, rows, dtype=dtype, device=device).t()
        tensor.copy_(values.view(rows, cols))
        return tensor, None
    if layout == "strided":
        storage = torch.full((2 * count,), SENTINEL[dtype.is_floating_point], dtype=dtype, device=device)
        storage[::2] = values
        return storage[::2], storage[1::2]
    raise ValueError(layout)


def output_buffer(count: int, dtype: torch.dtype, layout: str, device="cpu"):
    """An output buffer pre-filled with the sentinel, so elements left unwritten show."""
    return stored_as(torch.full((count,), SENTINEL[dtype.is_floating_point], dtype=dtype), layout, device)


def device_of(group: Group) -> torch.device:
    """Where this rank's tensors live: the CPU, or its GPU (fabric on CUDA, NCCL)."""
    return getattr(group.transport, "device", torch.device("cpu"))


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

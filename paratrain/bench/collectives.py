"""What every rank runs for `paratrain bench collectives`: build inputs, warm up, time, check.

The conventions are nccl-tests' (doc/PERFORMANCE.md there), so numbers compare directly:

- size is the bytes of the per-rank buffer nccl-tests reports for each op: the input of
  reduce_scatter (the output of all_gather), the one buffer of all_reduce/broadcast/reduce,
  the send buffer of all_to_all. It is also the size `Group` hands the algorithm table, so
  `auto` resolves here exactly as it would in a training step.
- algbw = size / time; busbw = algbw x a per-op factor that makes the number comparable with
  the link (here: memory) bandwidth whatever the world size.
- time is per call: on each rank the median of bursts of calls (the algorithms take turns), then
  the slowest rank's.
- #wrong: inputs hold small integers whose reduction is exact in every dtype; after timing,
  inputs are reset and the collective runs once more, and mismatching elements are counted.
- crossed: in a world that spans hosts, the bytes that checked call sent from one host to
  another, all ranks together (transport/base.py's Traffic: our messages counted, the
  backend's own collectives modelled as gloo's rings).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from paratrain.comm.algorithms import UNEVEN_ALL_TO_ALL
from paratrain.comm.choice import AlgorithmTable
from paratrain.comm.ops import part_bounds

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
REDUCING_OPS = ("all_reduce", "reduce_scatter", "reduce")
ROOTED_OPS = ("broadcast", "reduce")
ROOT = 0  # nccl-tests' default root


BURSTS = 10  # timed bursts per algorithm and size, interleaved across algorithms

# The all-to-all with split sizes, as the sweep names it (--splits uneven): every rank sends the
# same buffer size as the even all_to_all, cut by UNEVEN_RULE.
UNEVEN_OP = "all_to_all_uneven"
UNEVEN_RULE = ("every rank sends part j of its buffer to rank j, part j's size in proportion to 2^(n-1-j) "
               "(rank 0 receives the most, as a popular expert does): 2/3 and 1/3 on 2 ranks, 4/7, 2/7 and "
               "1/7 on 3; rounded down, the rest to part 0")


SPLITS = ("even", "uneven", "both")


def with_splits(plan: list[tuple[str, tuple[str, ...]]], splits: str) -> tuple[list, list[str]]:
    """The plan's all_to_all in equal parts, in UNEVEN_RULE's (UNEVEN_OP, with the algorithms that
    take split sizes), or both; and a note for each algorithm the uneven one lacks."""
    if splits == "even":
        return plan, []
    result, notes = [], []
    for op, algos in plan:
        if op != "all_to_all":
            result.append((op, algos))
            continue
        if splits == "both":
            result.append((op, algos))
        takes = tuple(a for a in algos if a in UNEVEN_ALL_TO_ALL or a == "auto")
        notes += [f"{a} takes equal parts only: skipped for {UNEVEN_OP}" for a in algos if a not in takes]
        if takes:
            result.append((UNEVEN_OP, takes))
    return result, notes


def uneven_splits(count: int, world_size: int) -> list[int]:
    """UNEVEN_RULE's part sizes of a buffer of `count` elements (the same on every rank)."""
    weights = [1 << (world_size - 1 - j) for j in range(world_size)]
    sizes = [count * weight // sum(weights) for weight in weights]
    sizes[0] += count - sum(sizes)
    return sizes


def bus_factor(op: str, world_size: int) -> float | None:
    """busbw / algbw for `op` (PERFORMANCE.md's table); None for the barrier, which moves no data."""
    n = world_size
    if op == "barrier":
        return None
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all", UNEVEN_OP):
        return (n - 1) / n
    return 1.0  # broadcast, reduce: all data leaves (or reaches) the root through one link


def element_counts(sizes: list[int], dtype: str) -> list[int]:
    """Element counts for the requested byte sizes: rounded down, at least one element (zero
    only for a requested size of zero), each count once."""
    element_size = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    counts: list[int] = []
    for nbytes in sizes:
        count = 0 if nbytes == 0 else max(1, nbytes // element_size)
        if count not in counts:
            counts.append(count)
    return counts


@dataclass(frozen=True)
class Sweep:
    """Everything a rank needs to know; pickled to every process, so plain data only."""

    plan: tuple[tuple[str, tuple[str, ...]], ...]  # (op, algorithms to run for it), in order
    counts: tuple[int, ...]
    dtype: str
    warmup: int
    iters: int
    table: AlgorithmTable | None = None  # what `auto` consults; None: the Group's own

    def counts_for(self, op: str) -> tuple[int, ...]:
        return (0,) if op == "barrier" else self.counts  # a barrier has no size to sweep

    def measurements(self) -> int:
        return sum(len(algos) * len(self.counts_for(op)) for op, algos in self.plan)


@dataclass
class Measurement:
    op: str
    algo: str
    resolved: str  # what `algo` ran as: itself, or auto's pick
    bytes: int
    count: int
    dtype: str
    time_us: float
    algbw_gbps: float | None
    busbw_gbps: float | None
    wrong: int
    bursts_us: tuple[float, ...] = ()  # per-call time of each burst, slowest rank's: what --tune weighs
    rounds_us: tuple[float, ...] = ()  # with --peer: each round's time, of which time_us is the median
    crossed_bytes: int | None = None  # bytes one call sent between hosts, all ranks'; None: one host
    crossed_modelled: int | None = None  # of which modelled (the backend's own collectives)

    @property
    def label(self) -> str:
        return f"auto({self.resolved})" if self.algo == "auto" else self.algo


@dataclass
class SweepResult:
    """What rank 0 hands back to the caller."""

    world_size: int
    transport: str
    device: str
    measurements: list[Measurement] = field(default_factory=list)


def run_sweep(group, sweep: Sweep) -> SweepResult | None:
    """The function every rank runs (module-level, so spawned processes can import it)."""
    if sweep.table is not None:
        group.table = sweep.table
    device = getattr(group.transport, "device", None) or torch.device("cpu")
    result = SweepResult(group.size, group.kind, str(device))
    progress = tqdm(
        total=sweep.measurements(), file=sys.stderr, leave=False, unit="run",
        disable=None if group.rank == 0 else True,  # None: only when stderr is a terminal
    )
    _warm_up(group, sweep, device)
    with progress:
        for op, algos in sweep.plan:
            for count in sweep.counts_for(op):
                case = _build_case(group, op, count, DTYPES[sweep.dtype], device)
                progress.set_description(f"{op} {case.nbytes} B")
                seconds = _time_interleaved(group, case, algos, sweep.warmup, sweep.iters, device)
                for algo in algos:
                    result.measurements.append(_measure(group, case, op, algo, seconds[algo], sweep, device))
                    progress.update()
    return result if group.rank == 0 else None


SWEEP_WARM_UP_CALLS = 100  # at 64 KiB or less; fewer above (at least 5), the same on every rank
SETTLE_S = 0.5  # calls before the sweep: a world's first second or two ran its calls slower


def _warm_up(group, sweep: Sweep, device) -> None:
    """Untimed calls of every op and algorithm at the sweep's first size, and barriers, before
    anything is timed: otherwise the first size pays for what a world does once (lazily made
    state, the shared segment's pages, the first calls' code paths, the cores' clocks ramping
    up). Measured: a 16 KiB all-reduce on 2 processes took 8.8 us as the first size of a sweep,
    5.4 us as the third. Every side of a comparison runs this same code (mpi_peer.py too)."""
    cases = [_build_case(group, op, sweep.counts_for(op)[0], DTYPES[sweep.dtype], device) for op, _ in sweep.plan]
    _settle(cases[0], sweep.plan[0][1][0], group, device)
    for case, (op, algos) in zip(cases, sweep.plan):
        case.reset()
        calls = max(5, min(SWEEP_WARM_UP_CALLS, SWEEP_WARM_UP_CALLS * (64 << 10) // max(case.nbytes, 1)))
        for algo in algos:
            for _ in range(calls):
                case.call(algo)
            group.barrier(algo="auto")
    _synchronize(device)


def _settle(case: _Case, algo: str, group, device) -> None:
    """About SETTLE_S of `case`'s call before anything is timed (rank 0 counts the calls and
    tells the others, so that all make as many). Seen on the 2-core machine: in a world's first
    second or two the 16 KiB all-reduce took 6.1-6.6 us a call, 4.7 us after; started after a
    3 s sleep, 4.7 us from the first call."""
    case.reset()
    started = time.perf_counter()
    for _ in range(3):
        case.call(algo)
    calls = torch.tensor([min(int(SETTLE_S * 3 / max(time.perf_counter() - started, 1e-6)), 200_000)],
                         dtype=torch.int64, device=device)
    group.broadcast(calls, 0)
    for _ in range(int(calls.item())):
        case.call(algo)


def _measure(group, case: _Case, op: str, algo: str, bursts: list[float], sweep: Sweep, device) -> Measurement:
    case.reset()
    traffic = group.traffic
    before = (traffic.counted, traffic.modelled) if traffic is not None else (0, 0)
    case.call(algo)
    _synchronize(device)
    crossed = (traffic.counted - before[0], traffic.modelled - before[1]) if traffic is not None else (0, 0)
    wrong = case.count_wrong()
    # Every rank's (median, wrong, crossed bytes, bursts...) in one call: the slowest rank's time
    # and bursts, everyone's wrong elements and bytes. Bursts line up: each starts from a barrier.
    mine = torch.tensor([statistics.median(bursts), float(wrong), *crossed, *bursts], dtype=torch.float64,
                        device=device)
    everyone = group.all_gather(mine.new_empty(mine.numel() * group.size), mine, algo="native")
    everyone = everyone.cpu().view(group.size, mine.numel())
    seconds, wrong = everyone[:, 0].max().item(), int(everyone[:, 1].sum().item())
    counted, modelled = (int(everyone[:, column].sum().item()) for column in (2, 3))
    slowest_bursts = tuple(everyone[:, 4:].max(dim=0).values.mul(1e6).tolist())
    spans = group.hosts is not None and len(group.hosts) > 1
    factor = bus_factor(op, group.size)
    algbw = None if factor is None else case.nbytes / seconds / 1e9
    return Measurement(
        op=op, algo=algo, resolved=_resolved(group, op, algo, case.nbytes), bytes=case.nbytes,
        count=case.count, dtype=sweep.dtype, time_us=seconds * 1e6, algbw_gbps=algbw,
        busbw_gbps=None if factor is None else algbw * factor, wrong=wrong, bursts_us=slowest_bursts,
        crossed_bytes=counted + modelled if spans else None, crossed_modelled=modelled if spans else None,
    )


def _resolved(group, op: str, algo: str, nbytes: int) -> str:
    """What `algo` runs as: the Group's pick for `auto` (with split sizes, by transport alone)."""
    if op != UNEVEN_OP:
        return group.resolve(op, algo, nbytes)
    return group.choose("all_to_all", None).algo if algo == "auto" else algo


def _time_interleaved(group, case: _Case, algos, warmup: int, iters: int, device) -> dict[str, list[float]]:
    """Seconds per call of each algorithm on this rank, one figure per burst of calls.

    The iterations are run in bursts, the algorithms taking turns (in a rotating order), so
    that a noisy moment on a shared machine falls on all of them alike instead of on
    whichever happened to run then. Buffers are not reset between calls, so in-place
    reductions grow (to inf, or wrapping integers): the timed work stays the same, and the
    result is checked separately on fresh inputs.
    """
    case.reset()
    for algo in algos:
        for _ in range(warmup):
            case.call(algo)
    bursts = min(iters, BURSTS)
    per_burst = -(-iters // bursts)
    per_call = {algo: [] for algo in algos}
    for burst in range(bursts):
        shift = burst % len(algos)
        for algo in algos[shift:] + algos[:shift]:
            # Start together, so no rank's clock includes waiting for a slower rank (with the
            # tightest barrier at hand: gloo's lets ranks go tens of microseconds apart).
            group.barrier(algo="auto")
            _synchronize(device)
            start = time.perf_counter()
            for _ in range(per_burst):
                case.call(algo)
            _synchronize(device)
            per_call[algo].append((time.perf_counter() - start) / per_burst)
    # Callers take the median burst: one burst hit by another program's time slice does not count.
    return per_call


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- inputs and expected results ---------------------------------------------------------


@dataclass
class _Case:
    """One op at one size on this rank: its buffers, how to call it, what it must produce."""

    call: Callable[[str], None]  # call(algo) runs the collective once
    nbytes: int
    count: int
    inputs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (buffer, initial)
    result: torch.Tensor | None = None
    expected: torch.Tensor | None = None

    def reset(self) -> None:
        for buffer, initial in self.inputs:
            buffer.copy_(initial)

    def count_wrong(self) -> int:
        if self.result is None:
            return 0
        return int((self.result != self.expected).sum().item())


def _pattern(rank: int, start: int, count: int, span: int, dtype, device) -> torch.Tensor:
    """Element i of rank r's data is (i + r) % span + 1: it differs between neighbouring ranks
    and positions, so a misplaced block shows, and stays a small integer."""
    values = torch.arange(start, start + count, dtype=torch.int64, device=device)
    return values.add_(rank).remainder_(span).add_(1).to(dtype)


def _summed_pattern(n: int, span: int, count: int, dtype, device):
    """total(start, length): the patterns' sum over n ranks at those positions. The patterns
    repeat every `span` elements, so their sum does too: one period of it, indexed, gives the
    expected reduction without building n buffers."""
    period = torch.tensor([sum((k + r) % span + 1 for r in range(n)) for k in range(span)], device=device)

    def total(start: int = 0, length: int = count) -> torch.Tensor:
        positions = torch.arange(start, start + length, device=device).remainder_(span)
        return period[positions].to(dtype)
    return total


def _build_case(group, op: str, count: int, dtype, device) -> _Case:
    n, rank = group.size, group.rank
    # Sums of n values up to `span` must stay exact in bfloat16 (integers up to 256).
    span = max(1, min(4, 256 // n))

    def data(r: int, start: int = 0, length: int = count) -> torch.Tensor:
        return _pattern(r, start, length, span, dtype, device)

    total = _summed_pattern(n, span, count, dtype, device)
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    bounds = part_bounds(count, n)
    mine_start, mine_end = bounds[rank]

    if op == "barrier":
        return _Case(lambda algo: group.barrier(algo=algo), 0, 0)
    if op == "all_reduce":
        buf = torch.empty(count, dtype=dtype, device=device)
        case = _Case(lambda algo: group.all_reduce(buf, "sum", algo=algo), nbytes, count, result=buf)
        case.inputs, case.expected = [(buf, data(rank))], total()
        return case
    if op == "reduce_scatter":
        inp = torch.empty(count, dtype=dtype, device=device)
        out = torch.empty(mine_end - mine_start, dtype=dtype, device=device)
        case = _Case(lambda algo: group.reduce_scatter(out, inp, "sum", algo=algo), nbytes, count, result=out)
        case.inputs, case.expected = [(inp, data(rank))], total(mine_start, mine_end - mine_start)
        return case
    if op == "all_gather":
        inp = torch.empty(mine_end - mine_start, dtype=dtype, device=device)
        out = torch.empty(count, dtype=dtype, device=device)
        case = _Case(lambda algo: group.all_gather(out, inp, algo=algo), nbytes, count, result=out)
        case.inputs = [(inp, data(rank, mine_start, mine_end - mine_start))]
        case.expected = torch.cat([data(r, s, e - s) for r, (s, e) in enumerate(bounds)])
        return case
    if op == "broadcast":
        buf = torch.empty(count, dtype=dtype, device=device)
        case = _Case(lambda algo: group.broadcast(buf, ROOT, algo=algo), nbytes, count, result=buf)
        case.inputs, case.expected = [(buf, data(rank))], data(ROOT)
        return case
    if op == "reduce":
        buf = torch.empty(count, dtype=dtype, device=device)
        case = _Case(lambda algo: group.reduce(buf, ROOT, "sum", algo=algo), nbytes, count, result=buf)
        # Non-root buffers must come back untouched, so they are checked too.
        case.inputs, case.expected = [(buf, data(rank))], total() if rank == ROOT else data(rank)
        return case
    if op == "all_to_all":
        inp = torch.empty(count, dtype=dtype, device=device)
        out = torch.empty(n * (mine_end - mine_start), dtype=dtype, device=device)
        case = _Case(lambda algo: group.all_to_all(out, inp, algo=algo), nbytes, count, result=out)
        case.inputs = [(inp, data(rank))]
        case.expected = torch.cat([data(r, mine_start, mine_end - mine_start) for r in range(n)])
        return case
    if op == UNEVEN_OP:
        return _uneven_all_to_all_case(group, count, dtype, device, data)
    raise ValueError(f"unknown op {op!r}")


def _uneven_all_to_all_case(group, count: int, dtype, device, data) -> _Case:
    """UNEVEN_RULE's all-to-all: part r of every rank's buffer comes to rank r."""
    n, rank = group.size, group.rank
    send = uneven_splits(count, n)
    start, mine = sum(send[:rank]), send[rank]
    inp = torch.empty(count, dtype=dtype, device=device)
    out = torch.empty(n * mine, dtype=dtype, device=device)
    nbytes = count * inp.element_size()

    def call(algo: str) -> None:
        group.all_to_all(out, inp, algo=algo, output_split_sizes=[mine] * n, input_split_sizes=send)

    case = _Case(call, nbytes, count, result=out)
    case.inputs = [(inp, data(rank))]
    case.expected = torch.cat([data(r, start, mine) for r in range(n)])
    return case

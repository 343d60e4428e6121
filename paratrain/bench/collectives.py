"""What every rank runs for `paratrain bench collectives`: build inputs (collective_cases.py),
warm up, time, check.

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
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from paratrain.bench.collective_cases import UNEVEN_OP, Case, build_case
from paratrain.comm.choice import AlgorithmTable

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
REDUCING_OPS = ("all_reduce", "reduce_scatter", "reduce")
ROOTED_OPS = ("broadcast", "reduce")


BURSTS = 10  # timed bursts per algorithm and size, interleaved across algorithms


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
                case = build_case(group, op, count, DTYPES[sweep.dtype], device)
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
    cases = [build_case(group, op, sweep.counts_for(op)[0], DTYPES[sweep.dtype], device) for op, _ in sweep.plan]
    _settle(cases[0], sweep.plan[0][1][0], group, device)
    for case, (op, algos) in zip(cases, sweep.plan):
        case.reset()
        calls = max(5, min(SWEEP_WARM_UP_CALLS, SWEEP_WARM_UP_CALLS * (64 << 10) // max(case.nbytes, 1)))
        for algo in algos:
            for _ in range(calls):
                case.call(algo)
            group.barrier(algo="auto")
    _synchronize(device)


def _settle(case: Case, algo: str, group, device) -> None:
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


def _measure(group, case: Case, op: str, algo: str, bursts: list[float], sweep: Sweep, device) -> Measurement:
    case.reset()
    traffic = getattr(group, "traffic", None)  # MPI's stand-in group (mpi_peer.py) keeps no count
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
    hosts = getattr(group, "hosts", None)
    spans = hosts is not None and len(hosts) > 1
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


def _time_interleaved(group, case: Case, algos, warmup: int, iters: int, device) -> dict[str, list[float]]:
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

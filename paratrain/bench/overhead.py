"""`paratrain bench collectives --overhead`: what paratrain's call path costs over the raw
point-to-point it issues.

Each algorithm's call is recorded once where it meets the transport (every batch of sends and
receives it starts, every wait, every native collective), then replayed bare: on processes
straight on the process group's own `send`/`recv` (what `dist.isend`/`dist.irecv` end in) and
`work.wait()`, with an `add_` for each receive that reduces; where the ranks share a host, and
so their messages go through shared memory (transport/shm.py), and on threads, through the
transport's own `start` and `wait`. The replay runs no paratrain code between those calls (no Group, Link,
argument checks, flight recorder, algorithm or table lookup), so ours - bare is what paratrain
adds per call, moving the same messages between the same buffers. What an algorithm computes
outside its receives (direct's fold at the root, a reduce-scatter's scratch copy) is not
replayed, so it counts as ours.

Timing: one call at a time, each started from a barrier so that no rank's clock includes
waiting for another; ours and bare alternate, and which goes first alternates too. Per rank
the median over rounds, then the slowest rank's. Wall time and the calling thread's CPU time
are both reported: on a shared machine the CPU figure is the steadier of the two.

Both differences also hold the transport's own variance: when a send finds its receive already
posted, gloo writes it on the calling thread, otherwise later on its own thread, and a few
microseconds more or less between two calls decide which, and how long the other rank waits.
A second timing takes the calls as a training step makes them, back to back: interleaved
bursts of BURST_CALLS calls each, ours and bare, the median burst's time per call. Where a lone
call from a barrier mostly measures how fast two ranks' threads wake each other, a burst shows
what a call costs in a stream of them.

So each call is also made once more against a transport that moves nothing (every send and
receive returns done at once, a native collective returns at once): that time is paratrain's
call path and nothing else (argument checks, the table, the flight recorder, Group, Link, the
algorithm's steps), the figure the 50 us budget is about.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from paratrain.bench.collective_cases import build_case
from paratrain.bench.collectives import DTYPES, _synchronize
from paratrain.bench.stand_ins import NullTransport, RecordingTransport
from paratrain.comm.group import Group
from paratrain.comm.transport import SharedMemoryTransport
from paratrain.comm.transport.base import P2POp


def call_path_us(group: Group, op: str, count: int, dtype, device, algo: str, calls: int = 200) -> float:
    """Microseconds per call of paratrain's own code: `algo`'s call of `op` made `calls` times
    against a NullTransport (the median of five runs of calls/5)."""
    null = Group(NullTransport(group.transport), timeout=group.timeout, table=group.table,
                 segment_bytes=group.segment_bytes)
    case = build_case(null, op, count, dtype, device)
    case.reset()
    per_run = max(1, calls // 5)
    for _ in range(per_run):  # warm-up: scratch buffers made, code paths taken once
        case.call(algo)
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(per_run):
            case.call(algo)
        runs.append((time.perf_counter() - started) / per_run)
    return statistics.median(runs) * 1e6


def record_call(group: Group, op: str, count: int, dtype, device, algo: str):
    """Make one `algo` call of `op` through a recording transport. Returns the events and the
    recording group, whose buffers (and the case's) the events' tensors live in."""
    recorder = RecordingTransport(group.transport)
    recording = Group(recorder, timeout=group.timeout, table=group.table, segment_bytes=group.segment_bytes)
    case = build_case(recording, op, count, dtype, device)
    case.reset()
    case.call(algo)
    _synchronize(device)
    return recorder.events, (recording, case)


def bare_replay(events: list[tuple], transport, timeout: float, public_api: bool = False):
    """A function that issues `events` again with nothing between the transport's own calls;
    with `public_api`, on processes, through `dist.isend`/`dist.irecv` (what a user's own
    script would call) rather than through the transport (None on the fabric)."""
    shared_memory = isinstance(transport, SharedMemoryTransport)
    if public_api:  # through the process group (under shared memory: its gloo group)
        if transport.kind == "fabric":
            return None
        return _torch_replay(events, transport.inner if shared_memory else transport, public_api=True)
    if transport.kind == "fabric" or shared_memory:
        # The fabric's, or shared memory's (transport/shm_transport.py), start and wait.
        return _start_replay(events, transport, timeout)
    return _torch_replay(events, transport)


def _torch_replay(events, transport, public_api: bool = False):
    """The bare program: each step a (what, argument, extra) triple, everything it needs (the
    receive's staging buffer, where a reduction lands) decided here, before any timing."""
    pg, program, reductions = transport.pg, [], {}
    cuda = any(event[0] == "start" and event[1] and event[1][0][1].is_cuda for event in events)
    if cuda and public_api:
        return None  # NCCL's replay already goes through the public batch_isend_irecv
    index = 0
    for event in events:
        if event[0] == "start":
            posts = []
            for kind, tensor, peer, reduce in event[1]:
                if kind == "recv" and reduce:
                    staging = torch.empty_like(tensor)
                    reductions[index] = (tensor, staging)
                    tensor = staging
                if public_api:  # dist.isend(tensor, dst, group), in the world's rank numbers
                    posts.append((_public_send if kind == "send" else _public_recv, tensor,
                                  transport.global_ranks[peer], pg))
                else:  # pg.send(tensors, dst, tag), in the group's
                    posts.append((pg.send if kind == "send" else pg.recv, [tensor], peer, 0))
                index += 1
            if cuda:  # NCCL pairs sends with receives only inside one batch
                dist = torch.distributed
                posts = [dist.P2POp(dist.isend if post == pg.send else dist.irecv, tensors[0],
                                    transport.global_ranks[peer], pg)
                         for post, tensors, peer, _ in posts]
            program.append(("batch" if cuda else "post", posts, None))
        elif event[0] == "wait":
            program.append(("wait", event[1], reductions.get(event[1])))
        else:
            program.append(("native", getattr(transport, event[1]), event[2]))

    def replay() -> None:
        works = []
        for step, arg, extra in program:
            if step == "post":
                for post, tensors, peer, last in arg:
                    works.append(post(tensors, peer, last))
            elif step == "wait":
                works[arg].wait()
                if extra is not None:
                    extra[0].add_(extra[1])
            elif step == "batch":
                batch = torch.distributed.batch_isend_irecv(arg)
                works += [_Batch(batch)] * len(arg)
            else:
                arg(*extra)

    return replay


_public_send, _public_recv = torch.distributed.isend, torch.distributed.irecv


class _Batch:
    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _start_replay(events, transport, timeout):
    program = []
    for event in events:
        if event[0] == "start":
            ops = [P2POp(kind, tensor, peer, 0, reduce) for kind, tensor, peer, reduce in event[1]]
            program.append(("post", ops, None))
        elif event[0] == "wait":
            program.append(("wait", event[1], None))
        else:
            program.append(("native", getattr(transport, event[1]), event[2]))

    def replay() -> None:
        works = []
        for step, arg, extra in program:
            if step == "post":
                works += transport.start(arg)
            elif step == "wait":
                works[arg].wait(timeout)
            else:
                arg(*extra)

    return replay


BURST_CALLS = 5  # calls per burst
BURSTS = 6  # bursts per side


@dataclass
class OverheadRow:
    op: str
    algo: str
    bytes: int
    messages: int  # p2p sends and receives one call starts on rank 0
    ours_us: float
    bare_us: float
    ours_cpu_us: float
    bare_cpu_us: float
    path_us: float = 0.0  # paratrain's own code per call (against a NullTransport)
    burst_ours_us: float = 0.0  # per call, in bursts of back-to-back calls
    burst_bare_us: float = 0.0
    dist_us: float = math.nan  # the bare replay through dist.isend/irecv, alone (processes only)
    dist_cpu_us: float = math.nan

    @property
    def overhead_us(self) -> float:
        return self.ours_us - self.bare_us


def run_overhead(group: Group, plan, counts, dtype: str, warmup: int, rounds: int) -> list[OverheadRow] | None:
    """What every rank runs for --overhead; rank 0 returns the rows."""
    device = getattr(group.transport, "device", None) or torch.device("cpu")
    rows = []
    for op, algos in plan:
        for count in (0,) if op == "barrier" else counts:
            for algo in algos:
                rows.append(_measure(group, op, algo, count, DTYPES[dtype], device, warmup, rounds))
    return rows if group.rank == 0 else None


def _measure(group, op, algo, count, dtype, device, warmup, rounds) -> OverheadRow:
    chosen = group.resolve(op, algo, count * dtype.itemsize)
    events, keep_alive = record_call(group, op, count, dtype, device, chosen)
    bare = bare_replay(events, group.transport, group.timeout)
    public = bare_replay(events, group.transport, group.timeout, public_api=True)
    case = build_case(group, op, count, dtype, device)
    case.reset()
    ours = lambda: case.call(chosen)  # noqa: E731 - the sides below read best side by side
    sides = [("ours", ours), ("bare", bare)] + ([("dist", public)] if public is not None else [])
    for _ in range(warmup):
        for _, call in sides:
            call()
    times = {name: ([], []) for name, _ in sides}
    for round_ in range(rounds):
        turn = round_ % len(sides)  # each side goes first as often as the others
        for name, call in sides[turn:] + sides[:turn]:
            group.barrier(algo="native")
            cpu, wall = time.thread_time(), time.perf_counter()
            call()
            _synchronize(device)
            times[name][0].append(time.perf_counter() - wall)
            times[name][1].append(time.thread_time() - cpu)
    bursts = {"ours": [], "bare": []}
    for burst in range(2 * BURSTS):
        name, call = (("ours", ours), ("bare", bare))[(burst + burst // 2) % 2]  # ours bare bare ours ...
        group.barrier(algo="native")
        wall = time.perf_counter()
        for _ in range(BURST_CALLS):
            call()
        _synchronize(device)
        bursts[name].append((time.perf_counter() - wall) / BURST_CALLS)
    mine = [statistics.median(series) for name in ("ours", "bare") for series in times[name]]
    mine += [statistics.median(bursts["ours"]), statistics.median(bursts["bare"])]
    mine.append(_path_alone(group, op, count, dtype, device, chosen) * 1e-6)
    mine += [statistics.median(series) for series in times["dist"]] if "dist" in times else [math.nan] * 2
    medians = torch.tensor(mine, dtype=torch.float64, device=device)
    everyone = group.all_gather(medians.new_empty(len(mine) * group.size), medians, algo="native").cpu()
    slowest = everyone.view(group.size, len(mine)).max(dim=0).values.mul_(1e6).tolist()
    messages = sum(len(event[1]) for event in events if event[0] == "start")
    if not events:  # the shared segment's algorithms: no transport call to replay bare
        slowest[2] = slowest[3] = slowest[5] = slowest[7] = slowest[8] = math.nan
    del keep_alive
    return OverheadRow(op, algo if algo == chosen else f"{algo}({chosen})", count * dtype.itemsize, messages,
                       ours_us=slowest[0], ours_cpu_us=slowest[1], bare_us=slowest[2], bare_cpu_us=slowest[3],
                       burst_ours_us=slowest[4], burst_bare_us=slowest[5], path_us=slowest[6],
                       dist_us=slowest[7], dist_cpu_us=slowest[8])


def _path_alone(group: Group, op, count, dtype, device, algo) -> float:
    """call_path_us on each rank in turn, the others waiting in a barrier: ranks timing their
    paths at once would share the cores (4 processes on 2 cores doubled every path) and, on
    threads, one interpreter."""
    path = 0.0
    for turn in range(group.size):
        if turn == group.rank:
            path = call_path_us(group, op, count, dtype, device, algo)
        group.barrier(algo="native")
    return path


def _us(value: float, width: int, unit: str = "") -> str:
    """A figure, or '-' where there is none (nan: no bare replay for the shared segment's algorithms)."""
    if value != value:
        return f"{'-':>{width + len(unit)}}"
    return f"{value:>{width}.{2 if unit else 1}f}{unit}"


def overhead_lines(rows: list[OverheadRow], rounds: int) -> list[str]:
    lines = [
        "#",
        "# overhead: paratrain's call vs a bare replay of the same transport calls (same messages,",
        f"# same buffers). alone: one call at a time from a barrier, alternating, median of {rounds} rounds;",
        f"# burst: {BURSTS} interleaved bursts of {BURST_CALLS} back-to-back calls each, median per call.",
        "# Slowest rank. overhead = ours - bare (alone). cpu = the calling thread's CPU time (alone).",
        "# path = paratrain's own code per call: the same call against a transport that moves",
        "# nothing (checks, table, flight recorder, Group, Link, algorithm; no transport).",
        "# dist = the same bare replay through dist.isend/dist.irecv, as a user's own script would",
        "# post them (processes only; always over gloo's sockets, never shared memory), timed in the",
        "# same alternation as ours and bare. The shared segment's algorithms (oneshot, twoshot) make no",
        "# transport call to replay: no bare side ('-'); their path copies and reduces in a segment that",
        "# waits for no peer.",
        f"# {'op':<10}  {'size (B)':>9}  {'algo':<10}  {'msgs':>4}  {'ours':>8}  {'bare':>8}  {'overhead':>8}"
        f"  {'ratio':>6}  {'burst':>8}  {'burst':>8}  {'burst':>6}  {'ours':>7}  {'bare':>7}  {'path':>6}"
        f"  {'dist':>8}  {'ours /':>6}  {'dist':>7}",
        f"# {'':<10}  {'':>9}  {'':<10}  {'':>4}  {'alone':>8}  {'alone':>8}  {'':>8}"
        f"  {'alone':>6}  {'ours':>8}  {'bare':>8}  {'ratio':>6}  {'cpu':>7}  {'cpu':>7}  {'':>6}"
        f"  {'alone':>8}  {'dist':>6}  {'cpu':>7}",
        f"# {'':<10}  {'':>9}  {'':<10}  {'':>4}  {'(us)':>8}  {'(us)':>8}  {'(us)':>8}"
        f"  {'':>6}  {'(us)':>8}  {'(us)':>8}  {'':>6}  {'(us)':>7}  {'(us)':>7}  {'(us)':>6}"
        f"  {'(us)':>8}  {'':>6}  {'(us)':>7}",
    ]
    for r in rows:
        lines.append(
            f"  {r.op:<10}  {r.bytes:>9}  {r.algo:<10}  {r.messages:>4}  {r.ours_us:>8.1f}  {_us(r.bare_us, 8)}"
            f"  {_us(r.overhead_us, 8)}  {_us(r.ours_us / r.bare_us, 5, 'x')}  {r.burst_ours_us:>8.1f}"
            f"  {_us(r.burst_bare_us, 8)}  {_us(r.burst_ours_us / r.burst_bare_us, 5, 'x')}  {r.ours_cpu_us:>7.1f}"
            f"  {_us(r.bare_cpu_us, 7)}  {r.path_us:>6.1f}"
            + (f"  {r.dist_us:>8.1f}  {r.ours_us / r.dist_us:>5.2f}x  {r.dist_cpu_us:>7.1f}" if r.dist_us == r.dist_us
               else f"  {'-':>8}  {'-':>6}  {'-':>7}")  # nan: no dist side on this transport
        )
    if rows:
        worst = max(rows, key=lambda r: r.path_us)
        lines.append(f"# largest path: {worst.path_us:.1f} us ({worst.op} {worst.algo} at {worst.bytes} B); "
                     f"budget 50 us: {'within' if worst.path_us <= 50 else 'OVER'}")
        ratios = [r.burst_ours_us / r.burst_bare_us for r in rows if r.messages and r.burst_bare_us == r.burst_bare_us]
        if ratios:
            lines.append(f"# burst ratio of our algorithms (ours / bare, per call): {min(ratios):.2f}x to {max(ratios):.2f}x")
        public = [r for r in rows if r.messages and r.dist_us == r.dist_us]
        if public:
            wall = [r.ours_us / r.dist_us for r in public]
            cpu = [r.ours_cpu_us / r.dist_cpu_us for r in public]
            lines.append(f"# our algorithms / the dist.isend/irecv replay, alone: wall {min(wall):.2f}x to {max(wall):.2f}x, "
                         f"cpu {min(cpu):.2f}x to {max(cpu):.2f}x")
    return lines

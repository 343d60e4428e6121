"""What every rank runs for `paratrain bench p2p`: every pair's links, one pair at a time.

For each pair (a, b) and size S, with the other ranks waiting at a barrier:

- unidirectional a -> b: a sends S bytes and b answers with a 1-byte ack, `iters` times; the
  time of one message is the median round (a shared machine's preemptions fall on a few rounds,
  not on the median). Run both ways, so the matrix has a -> b and b -> a. Half the round at the
  smallest size is the latency; bandwidth is S / round, the ack's latency included.
- bidirectional a <-> b: both send S and receive S at once (sendrecv); the bandwidth counts both
  directions' bytes: 2S / median round.

Then the all-to-all aggregate: every rank sends S(n-1)/n to the others at once (the group's
all_to_all, `auto`: on one host through the shared segment); per-rank bandwidth is what one rank sends per second (median round of the slowest
rank), aggregate n times that.

Each rank times only the tests it leads and writes the seconds into its slot of a table that
one all-reduce (max) hands to rank 0, so no rank ever has to know another's clock.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

TESTS = ("uni", "bi", "all_to_all")


SETTLE_S = 0.5  # of untimed rounds before the sweep (see _settle)


@dataclass(frozen=True)
class P2PSweep:
    sizes: tuple[int, ...]   # bytes per message (all_to_all: each rank's whole buffer)
    warmup: int
    iters: int

    def plan(self, world_size: int) -> list[tuple[str, int, int, int]]:
        """(test, src, dst, bytes) in the order every rank runs them; src -1 for all_to_all."""
        steps = []
        for a in range(world_size):
            for b in range(a + 1, world_size):
                for size in self.sizes:
                    steps += [("uni", a, b, size), ("uni", b, a, size), ("bi", a, b, size)]
        return steps + [("all_to_all", -1, -1, size) for size in self.sizes]


@dataclass
class P2PResult:
    world_size: int
    transport: str
    device: str
    records: list[dict]


def run_p2p(group, sweep: P2PSweep) -> P2PResult | None:
    """The function every rank runs (module-level, so spawned processes can import it)."""
    device = getattr(group.transport, "device", None) or torch.device("cpu")
    steps = sweep.plan(group.size)
    seconds = torch.zeros(len(steps), dtype=torch.float64)
    buffers = {size: (torch.ones(max(size, 1), dtype=torch.uint8, device=device),
                      torch.empty(max(size, 1), dtype=torch.uint8, device=device)) for size in sweep.sizes}
    ack = torch.zeros(1, dtype=torch.uint8, device=device)
    _settle(group, *buffers[sweep.sizes[0]], ack, device)
    for index, (test, src, dst, size) in enumerate(steps):
        out, into = buffers[size]
        group.barrier(algo="native")
        if test == "uni" and group.rank in (src, dst):
            elapsed = _one_way(group, src, dst, out, into, ack, sweep)
        elif test == "bi" and group.rank in (src, dst):
            elapsed = _both_ways(group, dst if group.rank == src else src, out, into, sweep)
        elif test == "all_to_all":
            elapsed = _all_to_all(group, size, device, sweep)
        else:
            continue
        if group.rank == src or test == "all_to_all":
            seconds[index] = elapsed
    # A pair's slot is filled by its sender alone; all_to_all's by every rank, and the slowest
    # rank's time is the one reported (as nccl-tests do). A max does both.
    group.all_reduce(seconds, "max", algo="native")
    if group.rank != 0:
        return None
    records = [make_record(test, src, dst, size, seconds[index].item(), group.size)
               for index, (test, src, dst, size) in enumerate(steps)]
    # "shm": processes of one host, point-to-point through shared memory (comm/transport/shm_transport.py)
    return P2PResult(group.size, group.kind, str(device), records)


def make_record(test: str, src: int, dst: int, size: int, elapsed: float, n: int) -> dict:
    moved = {"uni": size, "bi": 2 * size, "all_to_all": size * (n - 1) / n}[test]
    record = {"test": test, "src": src, "dst": dst, "bytes": size, "time_us": elapsed * 1e6,
              "gbps": moved / elapsed / 1e9 if elapsed > 0 else None}
    if test == "uni":
        record["latency_us"] = elapsed * 1e6 / 2  # half the round: meaningful at small sizes
    if test == "all_to_all":
        record["aggregate_gbps"] = record["gbps"] * n if record["gbps"] else None
    return record


def _median_round(step, sweep: P2PSweep) -> float:
    for _ in range(sweep.warmup):
        step()
    rounds = []
    for _ in range(sweep.iters):
        start = time.perf_counter()
        step()
        rounds.append(time.perf_counter() - start)
    return statistics.median(rounds)


def _ping_pong(group, src: int, dst: int, out, into, ack):
    """The round of the one-way test: src sends `out`, dst answers with a 1-byte ack."""
    def step() -> None:
        if group.rank == src:
            group.send(out, dst)
            group.recv(ack, dst)
        else:
            group.recv(into, src)
            group.send(ack, src)

    return step


def _one_way(group, src: int, dst: int, out, into, ack, sweep: P2PSweep) -> float:
    return _median_round(_ping_pong(group, src, dst, out, into, ack), sweep)


def _settle(group, out, into, ack, device) -> None:
    """About SETTLE_S of ranks 0 and 1's round at the first size before anything is timed, as
    the collectives' sweep does (collectives._settle): a world's first second or two ran slower,
    and the first size is the one whose time is the latency. Rank 0 counts the rounds and tells
    the others, so that both make as many."""
    step = _ping_pong(group, 0, 1, out, into, ack) if group.rank in (0, 1) else None
    started = time.perf_counter()
    if step is not None:
        for _ in range(3):
            step()
    rounds = torch.tensor([min(int(SETTLE_S * 3 / max(time.perf_counter() - started, 1e-6)), 100_000)],
                          dtype=torch.int64, device=device)
    group.broadcast(rounds, 0)
    if step is not None:
        for _ in range(int(rounds.item())):
            step()


def _both_ways(group, peer: int, out, into, sweep: P2PSweep) -> float:
    return _median_round(lambda: group.sendrecv(out, peer, into, peer), sweep)


def _all_to_all(group, size: int, device, sweep: P2PSweep) -> float:
    count = max(size // group.size, 1) * group.size
    out = torch.ones(count, dtype=torch.uint8, device=device)
    into = torch.empty_like(out)
    return _median_round(lambda: group.all_to_all(into, out, algo="auto"), sweep)

"""Ours beside a peer library (MPI, through mpi_peer.py): rounds that alternate, their figures
merged, and ours / peer per size.

Each side's round is a whole sweep in processes of its own; a figure is the median over
rounds of that round's figure (itself the median burst on the slowest rank), and every
round's figure is kept (`rounds_us`), so the spread between rounds shows beside the ratio.
ours / peer is a ratio of times: below 1, ours is faster.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from paratrain.bench.collectives import Measurement, SweepResult, bus_factor
from paratrain.bench.p2p import P2PResult, make_record


def alternate(rounds: int, ours: Callable[[], object], peer: Callable[[], object]) -> tuple[list, list]:
    """ours(), peer(), ours(), peer()...: `rounds` of each; each side's results in order."""
    mine, theirs = [], []
    for _ in range(rounds):
        mine.append(ours())
        theirs.append(peer())
    return mine, theirs


# ---- bench collectives -------------------------------------------------------------------


def sweep_rounds(rounds: int, ours: Callable[[], SweepResult], peer: Callable[[], tuple[SweepResult, str]]):
    """Our result with its measurements merged over the rounds, the peer's merged, the peer's name."""
    mine, theirs = alternate(rounds, ours, peer)
    result, library = mine[0], theirs[0][1]
    result.measurements = merge_measurements([r.measurements for r in mine], result.world_size)
    return result, merge_measurements([r.measurements for r, _ in theirs], result.world_size), library


def merge_measurements(rounds: list[list[Measurement]], world_size: int) -> list[Measurement]:
    """One measurement per (op, algorithm, size): the median round's time and the bandwidths
    that follow from it, every round's wrong elements, every round's time in rounds_us."""
    merged = []
    for same in zip(*rounds):
        first = same[0]
        times = tuple(m.time_us for m in same)
        time_us = statistics.median(times)
        factor = bus_factor(first.op, world_size)
        algbw = None if first.algbw_gbps is None else first.bytes / time_us / 1e3
        merged.append(Measurement(
            op=first.op, algo=first.algo, resolved=first.resolved, bytes=first.bytes, count=first.count,
            dtype=first.dtype, time_us=time_us, algbw_gbps=algbw,
            busbw_gbps=None if algbw is None or factor is None else algbw * factor,
            wrong=sum(m.wrong for m in same), rounds_us=times,
        ))
    return merged


def side_by_side(ours: list[Measurement], peer: list[Measurement]) -> list[Measurement]:
    """Both sides' rows in one list, the peer's row after ours at each (op, size)."""
    ops = list(dict.fromkeys(m.op for m in ours))
    key = {id(m): (ops.index(m.op), m.bytes, side) for side, rows in enumerate((ours, peer)) for m in rows}
    return sorted(ours + peer, key=lambda m: key[id(m)])


def collectives_lines(ours: list[Measurement], peer: list[Measurement], peer_name: str) -> list[str]:
    """Per op and size: each round's time on both sides and ours / peer; then the worst size."""
    theirs = {(m.op, m.bytes): m for m in peer}
    algos = list(dict.fromkeys(m.algo for m in ours))
    lines = ["#", f"# ours / {peer_name}: time per call (each round's, in the order run; after auto's, what it"
                  " ran), ratio of the medians (range of the rounds' ratios); below 1, ours is faster"]
    worst: dict[tuple[str, str], tuple[float, int]] = {}
    for op in dict.fromkeys(m.op for m in ours):
        lines += [f"# {op}", f"# {'size (B)':>10}  {peer_name + ' (us)':>22}"
                  + "".join(f"  {algo + ' (us)':>22}  {'ours / ' + peer_name:>22}" for algo in algos)]
        for nbytes in dict.fromkeys(m.bytes for m in ours if m.op == op):
            other = theirs[(op, nbytes)]
            cells = f"  {nbytes:>10}  {_rounds(other):>22}"
            for algo in algos:
                mine = next((m for m in ours if (m.op, m.bytes, m.algo) == (op, nbytes, algo)), None)
                if mine is None:
                    cells += f"  {'-':>22}  {'-':>22}"
                    continue
                ratio = mine.time_us / other.time_us
                ran = f" {mine.resolved}" if mine.algo == "auto" else ""  # what auto ran, as "auto(ring)"
                cells += f"  {_rounds(mine) + ran:>22}  {_ratio(ratio, _round_ratios(mine, other)):>22}"
                if ratio > worst.get((op, algo), (0.0, 0))[0]:
                    worst[(op, algo)] = (ratio, nbytes)
            lines.append(cells)
    for (op, algo), (ratio, nbytes) in worst.items():
        lines.append(f"# worst ours / {peer_name}: {ratio:.2f}x at {nbytes} B  ({op} {algo})")
    return lines


def _rounds(m: Measurement) -> str:
    return ", ".join(f"{t:.1f}" for t in m.rounds_us)


def _round_ratios(mine: Measurement, other: Measurement) -> list[float]:
    return [a / b for a, b in zip(mine.rounds_us, other.rounds_us)]


def _ratio(ratio: float, each: list[float]) -> str:
    spread = f" ({min(each):.2f}-{max(each):.2f})" if len(each) > 1 else ""
    return f"{ratio:.2f}x{spread}"


# ---- bench p2p ---------------------------------------------------------------------------


def p2p_rounds(rounds: int, ours: Callable[[], P2PResult], peer: Callable[[], tuple[P2PResult, str]]):
    """Our result with its records merged over the rounds, the peer's merged, the peer's name."""
    mine, theirs = alternate(rounds, ours, peer)
    result, library = mine[0], theirs[0][1]
    result.records = merge_records([r.records for r in mine], result.world_size)
    return result, merge_records([r.records for r, _ in theirs], result.world_size), library


def merge_records(rounds: list[list[dict]], world_size: int) -> list[dict]:
    """One p2p record per (test, src, dst, size): the median round's time, and what follows
    from it (bandwidth, latency), with every round's time in rounds_us."""
    merged = []
    for same in zip(*rounds):
        first = same[0]
        times = [r["time_us"] for r in same]
        record = make_record(first["test"], first["src"], first["dst"], first["bytes"],
                            statistics.median(times) / 1e6, world_size)
        merged.append(dict(record, rounds_us=times))
    return merged


def p2p_lines(ours: list[dict], peer: list[dict], peer_name: str) -> list[str]:
    """Per size and test, the median over links of each side's round (uni: a message and its
    ack; bi: both ways at once; all_to_all: the slowest rank's), and ours / peer."""
    lines = ["#", f"# ours / {peer_name}: median over links of the time of one round (each round's, in the"
                  " order run), ratio of the medians (range of the rounds' ratios); below 1, ours is faster",
             f"# {'size (B)':>10}  {'test':<10}  {'ours (us)':>22}  {peer_name + ' (us)':>22}  {'ours / ' + peer_name:>22}"]
    for nbytes in sorted({r["bytes"] for r in ours}):
        for test in ("uni", "bi", "all_to_all"):
            mine, theirs = _over_links(ours, test, nbytes), _over_links(peer, test, nbytes)
            if mine is None or theirs is None:
                continue
            each = [a / b for a, b in zip(mine, theirs)]
            lines.append(f"  {nbytes:>10}  {test:<10}  {_list(mine):>22}  {_list(theirs):>22}"
                         f"  {_ratio(statistics.median(mine) / statistics.median(theirs), each):>22}")
    small, big = min(r["bytes"] for r in ours), max(r["bytes"] for r in ours)
    for label, nbytes, key, unit in (("one-way latency", small, "latency_us", "us"), ("bandwidth", big, "gbps", "GB/s")):
        mine, theirs = _median_of(ours, nbytes, key), _median_of(peer, nbytes, key)
        if mine and theirs:
            lines.append(f"# {label} at {nbytes} B (uni, median over links): ours {mine:.3g} {unit},"
                         f" {peer_name} {theirs:.3g} {unit}")
    return lines


def _over_links(records: list[dict], test: str, nbytes: int) -> list[float] | None:
    """Per round, the median over the links of `test` at `nbytes`."""
    rows = [r["rounds_us"] for r in records if r["test"] == test and r["bytes"] == nbytes]
    return [statistics.median(times) for times in zip(*rows)] if rows else None


def _median_of(records: list[dict], nbytes: int, key: str) -> float | None:
    values = [r[key] for r in records if r["test"] == "uni" and r["bytes"] == nbytes and r.get(key)]
    return statistics.median(values) if values else None


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)

"""`bench collectives --explain`: which algorithm `auto` picks for each op and size, and why."""

from __future__ import annotations

import click
import torch

from paratrain.bench import report
from paratrain.bench.collectives import DTYPES
from paratrain.comm.choice import AlgorithmTable


def print_explain(table: AlgorithmTable, plan, counts: list[int], dtype: str, world_size: int,
                   transport: str) -> None:
    lines = [
        f"# what auto picks: transport {report.describe_kind(transport)}, world size {world_size}",
        f"# algorithm table {table.path}: {table.status}",
        f"# {'op':<16}  {'size (B)':>10}  {'algo':<8}  why",
    ]
    element_size = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    natives = 0
    for op, _ in plan:
        for nbytes in [0] if op == "barrier" else [count * element_size for count in counts]:
            choice = table.choose(op, nbytes, world_size, transport)
            lines.append(f"  {op:<16}  {nbytes:>10}  {choice.algo:<8}  {choice.reason}")
            natives += choice.algo == "native" and op != "barrier"
    if transport == "gloo" and natives:
        lines += [f"# {line}" for line in WHY_GLOO_WINS]
    click.echo("\n".join(lines))


# What --explain adds where gloo's own collective is kept: what measuring showed about why it can
# beat algorithms that move no more bytes than it does.
WHY_GLOO_WINS = (
    "where gloo's own is kept, this is why it can win:",
    " - gloo runs the whole schedule in C++ on its own threads; ours drives each step from the calling",
    "   Python thread (tens of us of Python per call: see --overhead), and every step wakes that thread.",
    "   On a machine whose cores are all busy a wake-up can wait for a core: a 4 ms scheduler tick on the",
    "   2-core machine, so the algorithm with more steps loses more often.",
    " - steps: the ring takes 2(n-1) of them, halving-doubling 2 log2(n) (plus 2 where n is not a power of",
    "   two); below about 1 MiB the steps, not the bytes, set the time, so the ring falls behind from 4 ranks.",
    " - from about 16 MiB every algorithm is bound by memory bandwidth (each byte is received, added and",
    "   sent), so ours and gloo's are within the noise of each other and the table keeps gloo's.",
)

"""The inputs of `paratrain bench collectives` and the results they must give: each op at one size
on one rank (`build_case`), its buffers filled with small integers whose reduction is exact in
every dtype, and what the call must leave in them. collectives.py times these calls, then checks
one on fresh inputs (`Case.count_wrong`); overhead.py times the same calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from paratrain.comm.ops import part_bounds

ROOT = 0  # nccl-tests' default root

# The all-to-all with split sizes, as the sweep names it (--splits uneven): every rank sends the
# same buffer size as the even all_to_all, cut by UNEVEN_RULE.
UNEVEN_OP = "all_to_all_uneven"
UNEVEN_RULE = ("every rank sends part j of its buffer to rank j, part j's size in proportion to 2^(n-1-j) "
               "(rank 0 receives the most, as a popular expert does): 2/3 and 1/3 on 2 ranks, 4/7, 2/7 and "
               "1/7 on 3; rounded down, the rest to part 0")


def uneven_splits(count: int, world_size: int) -> list[int]:
    """UNEVEN_RULE's part sizes of a buffer of `count` elements (the same on every rank)."""
    weights = [1 << (world_size - 1 - j) for j in range(world_size)]
    sizes = [count * weight // sum(weights) for weight in weights]
    sizes[0] += count - sum(sizes)
    return sizes


@dataclass
class Case:
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


def build_case(group, op: str, count: int, dtype, device) -> Case:
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
        return Case(lambda algo: group.barrier(algo=algo), 0, 0)
    if op == "all_reduce":
        buf = torch.empty(count, dtype=dtype, device=device)
        case = Case(lambda algo: group.all_reduce(buf, "sum", algo=algo), nbytes, count, result=buf)
        case.inputs, case.expected = [(buf, data(rank))], total()
        return case
    if op == "reduce_scatter":
        inp = torch.empty(count, dtype=dtype, device=device)
        out = torch.empty(mine_end - mine_start, dtype=dtype, device=device)
        case = Case(lambda algo: group.reduce_scatter(out, inp, "sum", algo=algo), nbytes, count, result=out)
        case.inputs, case.expected = [(inp, data(rank))], total(mine_start, mine_end - mine_start)
        return case
    if op == "all_gather":
        inp = torch.empty(mine_end - mine_start, dtype=dtype, device=device)
        out = torch.empty(count, dtype=dtype, device=device)
        case = Case(lambda algo: group.all_gather(out, inp, algo=algo), nbytes, count, result=out)
        case.inputs = [(inp, data(rank, mine_start, mine_end - mine_start))]
        case.expected = torch.cat([data(r, s, e - s) for r, (s, e) in enumerate(bounds)])
        return case
    if op == "broadcast":
        buf = torch.empty(count, dtype=dtype, device=device)
        case = Case(lambda algo: group.broadcast(buf, ROOT, algo=algo), nbytes, count, result=buf)
        case.inputs, case.expected = [(buf, data(rank))], data(ROOT)
        return case
    if op == "reduce":
        buf = torch.empty(count, dtype=dtype, device=device)
        case = Case(lambda algo: group.reduce(buf, ROOT, "sum", algo=algo), nbytes, count, result=buf)
        # Non-root buffers must come back untouched, so they are checked too.
        case.inputs, case.expected = [(buf, data(rank))], total() if rank == ROOT else data(rank)
        return case
    if op == "all_to_all":
        inp = torch.empty(count, dtype=dtype, device=device)
        out = torch.empty(n * (mine_end - mine_start), dtype=dtype, device=device)
        case = Case(lambda algo: group.all_to_all(out, inp, algo=algo), nbytes, count, result=out)
        case.inputs = [(inp, data(rank))]
        case.expected = torch.cat([data(r, mine_start, mine_end - mine_start) for r in range(n)])
        return case
    if op == UNEVEN_OP:
        return _uneven_all_to_all_case(group, count, dtype, device, data)
    raise ValueError(f"unknown op {op!r}")


def _uneven_all_to_all_case(group, count: int, dtype, device, data) -> Case:
    """UNEVEN_RULE's all-to-all: part r of every rank's buffer comes to rank r."""
    n, rank = group.size, group.rank
    send = uneven_splits(count, n)
    start, mine = sum(send[:rank]), send[rank]
    inp = torch.empty(count, dtype=dtype, device=device)
    out = torch.empty(n * mine, dtype=dtype, device=device)
    nbytes = count * inp.element_size()

    def call(algo: str) -> None:
        group.all_to_all(out, inp, algo=algo, output_split_sizes=[mine] * n, input_split_sizes=send)

    case = Case(call, nbytes, count, result=out)
    case.inputs = [(inp, data(rank))]
    case.expected = torch.cat([data(r, start, mine) for r in range(n)])
    return case

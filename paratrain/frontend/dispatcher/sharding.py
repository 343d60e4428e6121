"""Where a tensor lives on its workers (`Placement`), and what each worker does for an
operation on tensors laid out over several of them (`decide`).

A tensor's layout is either *replicated* (every worker holds all of it) or *split* along one
axis (worker i of n holds part i, `torch.tensor_split`'s parts). Given the layouts of an
operation's inputs (already on the workers that run it), `decide` asks the operation's own
rule (its entry in `ops.py`, the rules in `sharding_rules.py`) and falls back to gathering the
split inputs first and running replicated: slower, never wrong. Random operations on a split
tensor draw each part on its own worker; on a replicated one they would draw different values
on each replica, so they are refused there. Nothing here touches a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.frontend.ops import Op
from paratrain.frontend.protocol.tensors import part_sizes
from paratrain.frontend.sharding_rules import Gather, ShardingDecision, SplitCall, Unsupported

@dataclass(frozen=True)
class Placement:
    workers: tuple[int, ...]
    split: int | None = None  # the axis split over `workers`; None: replicated

    def describe(self) -> str:
        where = ",".join(map(str, self.workers))
        return f"split {self.split} over [{where}]" if self.split is not None else f"on [{where}]"


def local_shapes(shape: tuple, placement: Placement) -> list[tuple]:
    """Each worker's part of a tensor of `shape` (global)."""
    if placement.split is None:
        return [tuple(shape)] * len(placement.workers)
    axis = placement.split
    return [tuple(shape[:axis]) + (size,) + tuple(shape[axis + 1:])
            for size in part_sizes(shape[axis], len(placement.workers))]


def decide(op: Op, call: SplitCall) -> ShardingDecision:
    """What each of `call.n` workers does to run `op` on these layouts."""
    results = len(call.out_shapes)
    if call.n == 1 or all(call.splits[i] is None for i in call.targs):
        if op.random and call.n > 1 and call.kwargs.get("training", True):
            raise Unsupported(f"{call.name} on a tensor replicated on {call.n} workers would draw different "
                              "values on each: make the tensor split, or run it on one worker")
        return ShardingDecision(outs=[None] * results)
    found = op.sharding(call) if op.sharding is not None else None
    return found if found is not None else _gather_all(call.targs, call.splits, results)


def _gather_all(targs, splits, results: int) -> ShardingDecision:
    return ShardingDecision(convert={i: (Gather(splits[i]),) for i in targs if splits[i] is not None},
                            outs=[None] * results, note="gathered")

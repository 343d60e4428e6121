"""The data-parallel strategies, named once: each with what it shards, what it needs and combines
with, and how it is built. Everything that asks "is this run sharded?", "does it need a process
group?" or "does --algo apply?" reads the strategy's facts here, never the flags.

`--dp-mode` and `--zero` are two spellings of one choice, resolved by `resolve_strategy` alone:
`--zero 3` is `--dp-mode fsdp`, `--dp-mode torch --zero 1` is PyTorch's ZeroRedundancyOptimizer,
and a pair that asks for two different things (`--dp-mode naive --zero 2`) is a one-line error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from paratrain.errors import UserError

SHARDS = ("nothing", "optimizer state", "optimizer state and gradients",
          "optimizer state, gradients and parameters")


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str  # one line: what it does, for --help and the docs
    zero: int  # what it shards, as a ZeRO stage: 0 nothing, 1 optimizer state, 2 + gradients, 3 + parameters
    ours: bool  # written here (False: PyTorch's, run beside ours as the reference)
    with_tp_pp: bool  # composes with tensor and pipeline parallelism on the same mesh
    takes_algo: bool  # --algo chooses its collectives (PyTorch's run their own)
    compresses: bool = False  # --compress applies (it all-reduces whole gradients we can cast)
    gathers: bool = False  # runs reduce-scatter and all-gather with --algo (not all-reduce alone)
    # Needs the default torch.distributed process group (the processes launcher or torchrun); the
    # fabric's threads give PyTorch's DDP a gloo group of their own, but not the global one.
    needs_process_group: bool = False
    no_checkpoint: str = ""  # why a checkpoint cannot hold its state ("" : it can)
    aliases: tuple[str, ...] = field(default=())
    peer: str = "torch-ddp"  # PyTorch's strategy it is measured against (`paratrain bench ddp`)

    @property
    def shards(self) -> str:
        return SHARDS[self.zero]


STRATEGIES = {s.name: s for s in (
    Strategy("naive", "all-reduce every gradient after backward, one flat buffer or one per parameter",
             0, ours=True, with_tp_pp=True, takes_algo=True, compresses=True),
    Strategy("ddp", "ours: gradients in buckets, each all-reduced while backward goes on",
             0, ours=True, with_tp_pp=True, takes_algo=True, compresses=True),
    Strategy("torch-ddp", "PyTorch's DistributedDataParallel", 0, ours=False, with_tp_pp=False,
             takes_algo=False, aliases=("torch",)),
    Strategy("zero1", "ours: ZeRO-1, optimizer state sharded (reduce-scatter, step on the shard, all-gather)",
             1, ours=True, with_tp_pp=True, takes_algo=True, gathers=True, peer="torch-zero1"),
    Strategy("torch-zero1", "PyTorch's DDP with ZeroRedundancyOptimizer (ZeRO-1)", 1, ours=False,
             with_tp_pp=False, takes_algo=False, needs_process_group=True,
             no_checkpoint="PyTorch's ZeroRedundancyOptimizer keeps its state its own way; use zero1 (ours)",
             peer="torch-zero1"),
    # PyTorch has no ZeRO-2 of its own: it is measured against PyTorch's ZeRO-1.
    Strategy("zero2", "ours: ZeRO-2, optimizer state and gradients sharded", 2, ours=True, with_tp_pp=True,
             takes_algo=True, gathers=True, peer="torch-zero1"),
    Strategy("fsdp", "ours: ZeRO-3 / FSDP, parameters sharded too and gathered unit by unit",
             3, ours=True, with_tp_pp=True, takes_algo=True, gathers=True, aliases=("zero3",), peer="torch-fsdp"),
    Strategy("torch-fsdp", "PyTorch's FSDP2 (fully_shard) on the same units", 3, ours=False, with_tp_pp=False,
             takes_algo=False, needs_process_group=True,
             no_checkpoint="PyTorch's FSDP2 keeps its state as DTensors, which our checkpoints do not read; "
                           "use fsdp (ours)", peer="torch-fsdp"),
    Strategy("local-sgd", "ours: no gradient all-reduce; parameters averaged every --local-sgd K steps",
             0, ours=True, with_tp_pp=True, takes_algo=True,
             no_checkpoint="local SGD replicas hold different weights and momenta; a checkpoint saves one "
                           "replica's"),
)}
_BY_SPELLING = {spelling: s for s in STRATEGIES.values() for spelling in (s.name, *s.aliases)}
# Every name --dp-mode takes, the aliases included.
DP_MODES = tuple(_BY_SPELLING)
# What --zero K means with no --dp-mode (or with ddp, which the ZeRO stages extend), and with torch.
_OURS_BY_ZERO = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}
_TORCH_BY_ZERO = {0: "torch-ddp", 1: "torch-zero1", 3: "torch-fsdp"}


class StrategyError(UserError, ValueError):
    """--dp-mode, --zero and --local-sgd that name no strategy, or two; one line."""


def resolve_strategy(dp_mode: str | None = None, zero: int = 0, local_sgd: int = 0) -> Strategy:
    """The one strategy that --dp-mode, --zero and --local-sgd name together."""
    if isinstance(zero, bool) or not isinstance(zero, int) or zero not in _OURS_BY_ZERO:
        raise StrategyError(f"--zero must be 0, 1 (optimizer state sharded), 2 (and gradients) or 3 "
                            f"(and parameters: FSDP), got {zero!r}")
    if dp_mode is not None and (not isinstance(dp_mode, str) or dp_mode not in _BY_SPELLING):
        raise StrategyError(f"--dp-mode: unknown value {dp_mode!r}; valid: {', '.join(DP_MODES)}")
    named = _BY_SPELLING.get(dp_mode)
    if named is None:
        strategy = STRATEGIES["local-sgd" if local_sgd and not zero else _OURS_BY_ZERO[zero]]
    elif zero and named.name in ("ddp", "torch-ddp"):  # a ZeRO stage of that family
        family = _OURS_BY_ZERO if named.ours else _TORCH_BY_ZERO
        if zero not in family:
            raise StrategyError(f"--dp-mode {dp_mode} --zero {zero}: PyTorch has no ZeRO-{zero}; use zero{zero} "
                                "(ours), or torch with --zero 1 or 3")
        strategy = STRATEGIES[family[zero]]
    elif zero and zero != named.zero:
        raise StrategyError(f"--dp-mode {dp_mode} shards {named.shards} and --zero {zero} asks for "
                            f"{SHARDS[zero]}: give one of them")
    else:
        strategy = named
    if local_sgd and strategy.name != "local-sgd":
        raise StrategyError(f"--local-sgd {local_sgd} averages parameters instead of gradients, which "
                            f"{strategy.name} does not; drop it or use --dp-mode local-sgd")
    return strategy


def strategy_of(par) -> Strategy:
    """The strategy of a ParallelConfig (raises StrategyError; validation reports it first)."""
    return resolve_strategy(par.dp_mode, par.zero, par.local_sgd)


def strategy_problems(par, tp_pp: int, all_reduce_algos, gather_algos: Callable) -> list[str]:
    """One line per reason the strategy cannot run this configuration. `gather_algos(op)`: the
    algorithms a collective has."""
    try:
        s = strategy_of(par)
    except StrategyError as error:
        return [f"parallel: {error}"]
    problems = []
    if s.needs_process_group and par.launcher == "threads":
        problems.append(f"parallel: {s.name} is {s.summary}, which needs a default process group: use "
                        "--launcher processes (or torchrun)")
    if not s.with_tp_pp and tp_pp > 1:
        composing = [name for name, other in STRATEGIES.items() if other.with_tp_pp]
        problems.append(f"parallel: {s.name} works with data parallelism alone (pp = tp = 1); "
                        f"{', '.join(composing)} work with tp and pp")
    if par.algo != "auto" and not s.takes_algo:
        problems.append(f"parallel.algo: {s.name} ({s.summary}) runs its own collectives; --algo applies to ours")
    elif s.gathers and par.algo in all_reduce_algos:
        for op in ("reduce_scatter", "all_gather"):
            if par.algo not in gather_algos(op):
                problems.append(f"parallel.algo: {par.algo!r} has no {op}, which {s.name} runs; "
                                f"valid: {', '.join(gather_algos(op))}")
                break
    if par.compress not in ("none", "", None) and not s.compresses:
        problems.append(f"parallel.compress: compression is for naive and ddp (all-reduced gradients), not {s.name}")
    if s.name == "local-sgd" and not par.local_sgd:
        problems.append("parallel: local-sgd needs its period, --local-sgd K (steps between averages)")
    return problems


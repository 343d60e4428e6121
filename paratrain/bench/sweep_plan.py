"""What a `paratrain bench collectives` sweep measures, from its flags: the sizes (`ByteSize`,
`sweep_sizes`) and the (op, algorithms) pairs (`plan_sweep`; all_to_all in equal parts, uneven
ones or both, `with_splits`). Checked in the command's process, before any rank starts: a bad
flag ends the command in one line naming it. `bench p2p` reads sizes the same way.
"""

from __future__ import annotations

import re

import click

from paratrain.bench.collective_cases import UNEVEN_OP
from paratrain.comm.algorithms import HIERARCHICAL, OPS, SHARED_ALGORITHMS, UNEVEN_ALL_TO_ALL, algorithms_for

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_ALL_ALGOS = tuple(dict.fromkeys(a for op in OPS for a in algorithms_for(op, "any")))
SPLITS = ("even", "uneven", "both")  # --splits: how all_to_all cuts its buffers


class ByteSize(click.ParamType):
    """`65536`, `64K`, `64M`, `1G` (K = 1024, as nccl-tests); a trailing B or iB is allowed."""

    name = "size"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", str(value).upper())
        if not match:
            self.fail(f"{value!r} is not a size: give bytes, or a number with K, M or G (K=1024), e.g. 64K",
                      param, ctx)
        return int(match.group(1)) * _UNITS[match.group(2)]


def bad_option(option: str, message: str) -> click.BadParameter:
    """The error a bad `option` ends the command with, before any rank starts."""
    return click.BadParameter(message, param_hint=f"'{option}'")  # quoted, as click quotes its own


def _names(text: str, valid: tuple[str, ...], what: str, option: str) -> list[str]:
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise bad_option(option, f"no {what} given; valid: {', '.join(valid)}")
    for name in names:
        if name not in valid:
            raise bad_option(option, f"unknown {what} {name!r}; valid: {', '.join(valid)}")
    return names


def plan_sweep(ops_text: str | None, algos_text: str | None, skip_auto: bool, kind: str | None = None,
               spans_hosts: bool = False):
    """(op, algorithms) pairs to run on a transport of `kind`, and a note for each named algorithm
    some op lacks.

    By default every algorithm valid for an op runs (but `auto` with `skip_auto`, when tuning or
    measuring overhead: it would only repeat another one; and the hierarchical ones unless the
    world `spans_hosts`). An algorithm named explicitly must be valid for at least one named op.
    """
    ops = _names(ops_text, OPS, "op", "--ops") if ops_text else list(OPS)
    if algos_text is None:
        return [(op, tuple(a for a in algorithms_for(op, kind, spans_hosts) if not (skip_auto and a == "auto")))
                for op in ops], []
    algos = _names(algos_text, _ALL_ALGOS, "algorithm", "--algos")
    hier = [algo for algo in algos if algo in HIERARCHICAL]
    if hier and not spans_hosts:
        raise bad_option("--algos", f"algorithm {hier[0]!r} runs on a world that spans hosts: add "
                                    "--simulate-hosts N, or run under torchrun --nnodes")
    for algo in algos:
        if not any(algo in algorithms_for(op, kind, spans_hosts) for op in ops):
            if algo in SHARED_ALGORITHMS:
                raise bad_option("--algos", f"algorithm {algo!r} works through a segment of shared memory: "
                                            f"only on processes of one host (transport shm), not on {kind}")
            has_it = [op for op in OPS if algo in algorithms_for(op, kind, spans_hosts)]
            raise bad_option("--algos", f"algorithm {algo!r} is not available for {', '.join(ops)}"
                                        f" (it is for {', '.join(has_it)})")
    plan, notes = [], []
    for op in ops:
        valid = tuple(a for a in algos if a in algorithms_for(op, kind, spans_hosts))
        notes += [f"{a} is not available for {op}: skipped" for a in algos if a not in valid]
        if valid:
            plan.append((op, valid))
    return plan, notes


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


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min, min*factor, ... up to max; a zero minimum adds a zero-byte row, then starts at 1."""
    sizes, size = ([0], 1) if min_bytes == 0 else ([], min_bytes)
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes

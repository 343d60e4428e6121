"""A tensor's layout changed on its workers: Megatron's f, a scatter, or a gather (the sharding
rules, `sharding_rules.py`, say when each is asked for). Each makes a temporary copy in the new
layout; the collective runs on a process group of exactly those workers, made once."""

from __future__ import annotations

from paratrain.frontend.dispatcher.sharding import Placement
from paratrain.frontend.sharding_rules import EnterF, Gather, Scatter


def ensure_group(job, workers) -> None:
    """Collectives over `workers` need a process group of just them; make it once. Every worker
    takes part in making it (torch's groups are made by all ranks in one order: groups made by
    their members alone hang gloo once ranks have made different numbers of them)."""
    workers = tuple(workers)
    if len(workers) > 1 and workers not in job.router.groups and workers not in job.new_groups:
        job.new_groups.append(workers)
        job.on_all(range(job.router.n_workers), "make_group", [], [], [], {"g": list(workers)})


def convert(job, handle: int, conversion, workers) -> int:
    """A temporary copy of `handle` in the layout `conversion` asks for, on `workers`."""
    ensure_group(job, workers)
    return _CONVERSIONS[type(conversion)](job, handle, conversion, workers)


def _enter_f(job, handle: int, conversion: EnterF, workers) -> int:
    # One f per tensor and forward: its consumers (Q, K and V of one input) then share one
    # all-reduce in backward, as Megatron's fused QKV does.
    table = job.table
    key = (handle, tuple(workers))
    if key in table.entered:
        return table.entered[key]
    temp = job.temp(Placement(workers, None), table.meta[handle], keep=True)
    table.entered[key] = temp
    job.new_entered.append(key)
    job.on_all(workers, "tp_f", [temp], [handle], [0], {"g": list(workers)}, "f: all-reduce in backward")
    return _inherits_crossings(job, temp, handle)


def _scatter(job, handle: int, conversion: Scatter, workers) -> int:
    temp = job.temp(Placement(workers, conversion.axis), job.table.meta[handle])
    job.on_all(workers, "tp_scatter", [temp], [handle], [0], {"g": list(workers), "axis": conversion.axis},
               f"scatter along {conversion.axis}")
    return _inherits_crossings(job, temp, handle)


def _gather(job, handle: int, conversion: Gather, workers) -> int:
    meta, axis = job.table.meta[handle], conversion.axis
    temp = job.temp(Placement(workers, None), meta)
    job.on_all(workers, "tp_gather", [temp], [handle], [0], {"g": list(workers), "axis": axis, "length": meta[0][axis]},
               f"all-gather along {axis}")
    return _inherits_crossings(job, temp, handle)


_CONVERSIONS = {EnterF: _enter_f, Scatter: _scatter, Gather: _gather}


def _inherits_crossings(job, temp: int, handle: int) -> int:
    """The copy's gradient goes back through the crossings `handle` came by."""
    job.table.crossings[temp] = job.table.crossings.get(handle, frozenset())
    return temp


def forget_entered(job, handles=None) -> None:
    """Free the cached f's (of `handles`, or all of them): an f belongs to one forward."""
    table = job.table
    for key in [k for k in table.entered if handles is None or k[0] in handles]:
        job.temps.append(table.entered.pop(key))

"""A tensor's layout changed on its workers: Megatron's f, a scatter, or a gather (see
sharding.py for when each is asked for). Each makes a temporary copy in the new layout; the
collective runs on a process group of exactly those workers, made once."""

from __future__ import annotations

from paratrain.frontend.dispatcher.sharding import Placement


def ensure_group(job, workers) -> None:
    """Collectives over `workers` need a process group of just them; make it once. Every worker
    takes part in making it (torch's groups are made by all ranks in one order: groups made by
    their members alone hang gloo once ranks have made different numbers of them)."""
    workers = tuple(workers)
    if len(workers) > 1 and workers not in job.router.groups and workers not in job.new_groups:
        job.new_groups.append(workers)
        job.on_all(range(job.router.n_workers), "make_group", [], [], [], {"g": list(workers)})


def convert(job, handle: int, conversion: tuple, workers) -> int:
    """A temporary copy of `handle` in the layout `conversion` asks for, on `workers`."""
    table = job.table
    meta = table.meta[handle]
    ensure_group(job, workers)
    group = list(workers)
    if conversion[0] == "f":
        # One f per tensor and forward: its consumers (Q, K and V of one input) then share
        # one all-reduce in backward, as Megatron's fused QKV does.
        key = (handle, tuple(workers))
        if key in table.entered:
            return table.entered[key]
        temp = job.temp(Placement(workers, None), meta, keep=True)
        table.entered[key] = temp
        job.new_entered.append(key)
        job.on_all(workers, "tp_f", [temp], [handle], [0], {"g": group}, "f: all-reduce in backward")
    elif conversion[0] == "scatter":
        temp = job.temp(Placement(workers, conversion[1]), meta)
        job.on_all(workers, "tp_scatter", [temp], [handle], [0], {"g": group, "axis": conversion[1]},
                   f"scatter along {conversion[1]}")
    else:
        axis = conversion[1]
        temp = job.temp(Placement(workers, None), meta)
        job.on_all(workers, "tp_gather", [temp], [handle], [0], {"g": group, "axis": axis, "length": meta[0][axis]},
                   f"all-gather along {axis}")
    table.crossings[temp] = table.crossings.get(handle, frozenset())
    return temp


def forget_entered(job, handles=None) -> None:
    """Free the cached f's (of `handles`, or all of them): an f belongs to one forward."""
    table = job.table
    for key in [k for k in table.entered if handles is None or k[0] in handles]:
        job.temps.append(table.entered.pop(key))

"""Compiled regions at the dispatcher: telling each worker where one begins and ends.

The client marks a region whose signal says `compile: true` with `region_begin` and
`region_end` (see client/session.py). Which workers a region runs on is known only as its
instructions are routed (a region may place nothing and run where its inputs live, or move
tensors between stages), so a worker is told that the region began just before the first
instruction of it that the worker is given (`Job.commit` asks `OpenRegion.opening`), and that it ended
when the client's end arrives. Workers the region never reached hear nothing of it.
"""

from __future__ import annotations

from paratrain.frontend.dispatcher.table import Job, OpenRegion, Refused
from paratrain.frontend.protocol import Instruction


def begin(job: Job, instruction: Instruction) -> None:
    table = job.table
    name = instruction.kwargs.get("name")
    signal = table.signals.get(name) if type(name) is str else None
    if signal is None or not signal.compile:
        raise Refused(f"region_begin: signal {str(name)[:64]!r} is not configured with compile: true")
    if table.region is not None:  # only a raw client nests them: the open one ends here
        _close(job)
    table.region = OpenRegion(name)


def end(job: Job, instruction: Instruction) -> None:
    if job.table.region is not None:
        _close(job)


def _close(job: Job) -> None:
    region, job.table.region = job.table.region, None
    for worker in sorted(region.began):
        if job.router.is_alive(worker):
            job.emit(worker, Instruction(job.seq, "region_end", [], [], [], {"name": region.name},
                                         signal=region.name), region.name)

"""Routing an operation on tensors: where it runs, and what moves or changes layout first.

An operation runs on its signal's workers, or where its first tensor input lives. Inputs that
live elsewhere are moved there first (`moves.py`); inputs whose layout does not suit it change
layout on the way (`sharding.plan` says how, `conversions.py` does it); partial results are
summed after it (`post`). The common case, every input on the one worker that runs it, goes
there as the client wrote it.
"""

from __future__ import annotations

from paratrain.frontend.dispatcher import twins
from paratrain.frontend.dispatcher.conversions import convert, ensure_group
from paratrain.frontend.dispatcher.moves import move
from paratrain.frontend.dispatcher.sharding import Placement, Unsupported, plan
from paratrain.frontend.dispatcher.table import Refused, union_of
from paratrain.frontend.ops import OPS
from paratrain.frontend.protocol import Instruction

# These run where their first input lives, whatever signal is active: they act on it in place.
STAY = frozenset({"grad", "set_grad_none", "set_grad", "requires_grad_", "set_data", "detach"}) | {
    name for name, op in OPS.items() if op.kind == "inplace"}


def compute(job, instruction: Instruction) -> None:
    table, name = job.table, instruction.op
    signal = job.router.signal_of(table, instruction)
    if name in STAY:
        if table.twins and name not in ("grad", "detach"):
            twins.forget(job, instruction.args[instruction.targs[0]])  # it changes: its twin no longer equals it
        run_on(job, instruction, signal)
        return
    backward = twins.backward_elsewhere(table, instruction, signal)
    run_on(job, instruction, signal)
    if backward is not None:  # the region's backward runs on other workers: its twin runs there
        twin = twins.twin_instruction(job, instruction, backward)
        run_on(job, twin, backward)
        twins.tie(job, instruction, twin, backward)


def run_on(job, instruction: Instruction, signal) -> None:
    """Route one operation issued under `signal` (None: none that places anything)."""
    router, table = job.router, job.table
    name, outs, targs, where = instruction.op, instruction.outs, instruction.targs, table.where
    first = where[instruction.args[targs[0]]]
    workers = first.workers if signal is None or name in STAY else signal.workers
    if signal is None and router.auto_shard is not None and name not in STAY:
        workers = _split_input_workers(where, instruction.args, targs, workers)
    router.check_alive(workers)
    if len(workers) == 1 and _all_at(where, instruction.args, targs, first):
        _compute_here(job, instruction, first)  # the common case
        return
    args = list(instruction.args)
    inplace = OPS[name].kind == "inplace"
    for i in targs:
        if table.where[args[i]].workers != workers:
            if inplace and i == targs[0]:
                raise Refused(f"{name}: the tensor changed in place lives on other workers")
            args[i] = move(job, args[i], workers)
    out_metas = router.infer(table, name, args, targs, instruction.kwargs)
    if not inplace:
        table.meta.update(zip(outs, out_metas))  # known before emitting: the log shows them
    shapes = {i: table.meta[args[i]][0] for i in targs}
    splits = {i: table.where[args[i]].split for i in targs}
    try:
        steps = plan(name, args, targs, instruction.kwargs, shapes, splits, [m[0] for m in out_metas], len(workers))
    except Unsupported as error:
        raise Refused(f"{name}: {error}") from None
    inputs = list(args)  # the handles as they were, for steps after the operation
    for i, conversions in steps.convert.items():
        for conversion in conversions if isinstance(conversions, list) else [conversions]:
            args[i] = convert(job, args[i], conversion, workers)
    op_args = args + [None] * max(0, max(steps.args, default=-1) + 1 - len(args))
    for position, value in steps.args.items():
        op_args[position] = value
    op_targs = [i for i in targs if i not in steps.args]
    op_kwargs = dict(steps.kwargs) if steps.replace_kwargs else {**instruction.kwargs, **steps.kwargs}
    op_name = steps.op or name
    if op_name.startswith("vp_"):
        ensure_group(job, workers)
        op_kwargs["g"] = list(workers)
    note = ""
    if router.log is not None:
        layout = f"-> {Placement(workers, steps.outs[0]).describe()}" if steps.outs and len(workers) > 1 else ""
        note = router.note(workers, signal, f"{steps.note} {layout}".strip())
    results = list(outs) if not steps.post else [job.temp(Placement(workers, None), out_metas[0])]
    job.on_all(workers, op_name, results, op_args, op_targs, op_kwargs, note)
    if steps.post:
        _post(job, steps.post, results[0], outs[0], inputs, workers, out_metas[0])
    crossed = union_of(table.crossings.get(args[i]) for i in targs)
    targets = list(outs) if not inplace else [inputs[targs[0]]]
    splits_out = steps.outs if not inplace else [table.where[inputs[targs[0]]].split]
    for handle, meta, split in zip(targets, out_metas, splits_out):
        if not inplace:
            table.where[handle], table.meta[handle] = Placement(workers, split), meta
        router.add_crossings(table, handle, crossed)


def _compute_here(job, instruction: Instruction, placement: Placement) -> None:
    """Everything on one worker: the instruction goes there as the client wrote it."""
    router, table = job.router, job.table
    outs, args, targs = instruction.outs, instruction.args, instruction.targs
    out_metas = router.infer(table, instruction.op, args, targs, instruction.kwargs)
    inplace = OPS[instruction.op].kind == "inplace"
    if not inplace:
        for handle, meta in zip(outs, out_metas):
            table.where[handle], table.meta[handle] = placement, meta
    job.emit(placement.workers[0], instruction)
    crossed = table.crossings and union_of(table.crossings.get(args[i]) for i in targs)
    if crossed:
        for handle in ([args[targs[0]]] if inplace else outs):
            router.add_crossings(table, handle, crossed)


def _split_input_workers(where: dict, args: list, targs: list, default: tuple) -> tuple:
    """Auto-sharding: an operation runs where its first split input lives, so that a small
    operand (a weight, a bias, a target) is copied to the parts instead of the parts gathered
    to it, whichever side of the operator the program wrote it on."""
    for i in targs:
        placement = where[args[i]]
        if placement.split is not None:
            return placement.workers
    return default


def _all_at(where: dict, args: list, targs: list, placement: Placement) -> bool:
    for i in targs:
        if where[args[i]] != placement:
            return False
    return True


def _post(job, post, current, final, inputs, workers, meta) -> None:
    """The steps after a partial result: all-reduce, scale, add a bias."""
    ensure_group(job, workers)
    for index, step in enumerate(post):
        last = index == len(post) - 1
        target = final if last else job.temp(Placement(workers, None), meta)
        if step[0] == "g":
            job.on_all(workers, "tp_g", [target], [current], [0], {"g": list(workers)}, "all-reduce")
        elif step[0] == "scale":
            job.on_all(workers, "mul", [target], [current, step[1]], [0], {})
        else:
            job.on_all(workers, "add", [target], [current, inputs[step[1]]], [0, 1], {})
        current = target

"""Routing an operation on tensors: where it runs, and what moves or changes layout first.

An operation runs on its signal's workers, or where its first tensor input lives. Inputs that
live elsewhere are moved there first (`moves.py`); on several workers, the operation's sharding
rule decides (`sharding.decide`) and `run_on` carries the decision out: inputs change layout
(`conversions.py`), the operation runs on every worker as rewritten, partial results are summed
after it (post-steps). The common case, every input on the one worker that runs it, goes there
as the client wrote it.
"""

from __future__ import annotations

from paratrain.frontend.dispatcher import twins
from paratrain.frontend.dispatcher.conversions import convert, ensure_group
from paratrain.frontend.dispatcher.moves import move
from paratrain.frontend.dispatcher.sharding import Placement, decide
from paratrain.frontend.dispatcher.table import Refused, union_of
from paratrain.frontend.ops import OPS
from paratrain.frontend.protocol import Instruction
from paratrain.frontend.sharding_rules import AddInput, AllReduce, Scale, ShardingDecision, SplitCall, Unsupported

STAY = frozenset(name for name, op in OPS.items() if op.stays_with_input)


def compute(job, instruction: Instruction) -> None:
    table, name = job.table, instruction.op
    signal = job.router.signal_of(table, instruction)
    if name in STAY:
        if table.twins and OPS[name].changes_input:
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
    op = OPS[name]
    inplace = op.kind == "inplace"
    args = _moved(job, instruction, workers, inplace)
    out_metas = router.infer(table, name, args, targs, instruction.kwargs)
    if not inplace:
        table.meta.update(zip(outs, out_metas))  # known before emitting: the log shows them
    decision = _decide(op, instruction, args, table, out_metas, len(workers))
    inputs = list(args)  # the handles as they were, for the post-steps
    for i, conversions in decision.convert.items():
        for conversion in conversions:
            args[i] = convert(job, args[i], conversion, workers)
    results = list(outs) if not decision.post else [job.temp(Placement(workers, None), out_metas[0])]
    _emit(job, instruction, decision, args, results, workers, signal)
    if decision.post:
        _post(job, decision.post, results[0], outs[0], inputs, workers, out_metas[0])
    crossed = union_of(table.crossings.get(args[i]) for i in targs)
    targets = list(outs) if not inplace else [inputs[targs[0]]]
    splits_out = decision.outs if not inplace else [table.where[inputs[targs[0]]].split]
    for handle, meta, split in zip(targets, out_metas, splits_out):
        if not inplace:
            table.where[handle], table.meta[handle] = Placement(workers, split), meta
        router.add_crossings(table, handle, crossed)


def _moved(job, instruction: Instruction, workers, inplace: bool) -> list:
    """The arguments, each tensor moved to `workers` if it lives elsewhere."""
    args = list(instruction.args)
    for i in instruction.targs:
        if job.table.where[args[i]].workers != workers:
            if inplace and i == instruction.targs[0]:
                raise Refused(f"{instruction.op}: the tensor changed in place lives on other workers")
            args[i] = move(job, args[i], workers)
    return args


def _decide(op, instruction: Instruction, args: list, table, out_metas: list, n: int) -> ShardingDecision:
    targs = instruction.targs
    call = SplitCall(instruction.op, args, targs, instruction.kwargs, {i: table.meta[args[i]][0] for i in targs},
                     {i: table.where[args[i]].split for i in targs}, [meta[0] for meta in out_metas], n)
    try:
        return decide(op, call)
    except Unsupported as error:
        raise Refused(f"{instruction.op}: {error}") from None


def _emit(job, instruction: Instruction, decision: ShardingDecision, args: list, results: list, workers,
          signal) -> None:
    """The operation on every worker, as the decision rewrote it."""
    op_args = args + [None] * max(0, max(decision.args, default=-1) + 1 - len(args))
    for position, value in decision.args.items():
        op_args[position] = value
    op_targs = [i for i in instruction.targs if i not in decision.args]
    op_kwargs = dict(decision.kwargs) if decision.replace_kwargs else {**instruction.kwargs, **decision.kwargs}
    op_name = decision.op or instruction.op
    if OPS[op_name].collective:
        ensure_group(job, workers)
        op_kwargs["g"] = list(workers)
    note = ""
    if job.router.log is not None:
        layout = f"-> {Placement(workers, decision.outs[0]).describe()}" if decision.outs and len(workers) > 1 else ""
        note = job.router.note(workers, signal, f"{decision.note} {layout}".strip())
    job.on_all(workers, op_name, results, op_args, op_targs, op_kwargs, note)


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


def _post(job, post: tuple, current: int, final: int, inputs: list, workers, meta) -> None:
    """The steps after a partial result, each into a new temporary (the last into `final`)."""
    ensure_group(job, workers)
    for index, step in enumerate(post):
        target = final if index == len(post) - 1 else job.temp(Placement(workers, None), meta)
        _POST_STEPS[type(step)](job, step, current, target, inputs, workers)
        current = target


def _all_reduce(job, step: AllReduce, current: int, target: int, inputs: list, workers) -> None:
    job.on_all(workers, "tp_g", [target], [current], [0], {"g": list(workers)}, "all-reduce")


def _scale(job, step: Scale, current: int, target: int, inputs: list, workers) -> None:
    job.on_all(workers, "mul", [target], [current, step.factor], [0], {})


def _add_input(job, step: AddInput, current: int, target: int, inputs: list, workers) -> None:
    job.on_all(workers, "add", [target], [current, inputs[step.position]], [0, 1], {})


_POST_STEPS = {AllReduce: _all_reduce, Scale: _scale, AddInput: _add_input}

"""One instruction: an operation of the table (`ops.py`) on tensors named by handles.

A client numbers its instructions (`seq`, which errors name), chooses the handles of their
results itself (so a result costs no round trip), and says where it was issued (its signal
region, `gt.worker(k)`, grad mode). The dispatcher turns each into instructions for workers:
the same type, with the fields a worker needs.

On the wire an instruction is a list of its fields in the order below (batches hold hundreds;
names in every one would double their size). `check_instruction` is the one place that reads
that list, and it checks every field before anything else sees it.
"""

from __future__ import annotations

from typing import NamedTuple

from paratrain.frontend.ops import CLIENT_OPS, DTYPES, HANDLE_LISTS, ITEM_SIZES, OPS
from paratrain.frontend.protocol import fields
from paratrain.frontend.protocol.fields import MalformedMessage

CLIENT_HANDLES = 1 << 31  # a client's handles live below this; the dispatcher's temporaries above
MAX_ARGS = 4096  # positional arguments of one instruction (a cat of many tensors)
MAX_FREE = 1 << 20  # handles freed by one instruction


class Instruction(NamedTuple):
    seq: int  # the client's number for it (0 for a free); errors name it
    op: str  # a name in ops.OPS
    outs: list  # handles for its results (as many as the op makes)
    args: list  # positional arguments: plain values, and tensor handles at the positions in targs
    targs: list  # the positions in args that hold tensor handles
    kwargs: dict  # keyword arguments, from the op's allow-list
    no_grad: bool = False  # run outside autograd
    requires_grad: bool = False  # a created tensor becomes a leaf that requires grad
    worker: int | None = None  # client: the worker a created tensor goes to (gt.worker(k))
    signal: str | None = None  # client: the signal region it was issued in
    log: int | None = None  # dispatcher -> worker: its line in the instruction log, to time it


FIELD_COUNT = len(Instruction._fields)


_INT64_MIN, _INT64_MAX = fields.INT64
_LIMITS = {True: CLIENT_HANDLES - 1, False: _INT64_MAX}
# What the one-pass check needs of each operation: (results or None, fewest and most tensor
# arguments, allowed keywords, whether its arguments are all handles). Uploads always take the
# careful path (their frame is checked with the message's frames).
_SHAPES = {name: (op.results, op.inputs[0], op.inputs[1], op.kwargs, name in HANDLE_LISTS)
           for name, op in OPS.items() if name != "upload"}
_BY_SENDER = {True: {name: shape for name, shape in _SHAPES.items() if name in CLIENT_OPS}, False: _SHAPES}
_new = tuple.__new__


def check_instruction(raw, batch: str, index: int, from_client: bool) -> Instruction:
    """An Instruction from its wire form, every field checked; MalformedMessage otherwise.
    `from_client`: only the client's operations, and result handles below CLIENT_HANDLES.
    Errors name it `batch[index]`.

    Batches hold hundreds of instructions, so the common case (plain values only) is checked in
    one pass without naming fields; anything else, and every refusal, takes the careful path
    that names the field at fault. The one-pass check accepts nothing the careful one refuses
    (tests/test_frontend_instruction_checks.py holds them together)."""
    if type(raw) is list and len(raw) == FIELD_COUNT and _plainly_valid(raw, _BY_SENDER[from_client],
                                                                       _LIMITS[from_client]):
        return _new(Instruction, raw)
    return _check_carefully(raw, f"{batch}[{index}]", from_client)


def _plainly_valid(raw: list, shapes: dict, limit: int) -> bool:
    """True only if `raw` is a valid instruction whose arguments are all scalars (no lists)."""
    seq, op, outs, args, targs, kwargs, no_grad, requires_grad, worker, signal, log = raw
    shape = shapes.get(op) if type(op) is str else None
    if (shape is None or type(seq) is not int or not 0 <= seq <= _INT64_MAX or type(outs) is not list
            or type(args) is not list or type(targs) is not list or type(kwargs) is not dict
            or no_grad.__class__ is not bool or requires_grad.__class__ is not bool):
        return False
    results, fewest, most, keywords, handles_only = shape
    if len(outs) != results if results is not None else not 1 <= len(outs) <= 1024:
        return False
    if outs and not _handles(outs, limit):
        return False
    if handles_only:
        if len(args) > MAX_FREE or not _handles(args, limit):
            return False
    elif len(args) > MAX_ARGS or not _scalars(args):
        return False
    if not fewest <= len(targs) <= most:
        return False
    size = len(args)
    for i in targs:
        if type(i) is not int or not 0 <= i < size:
            return False
        handle = args[i]
        if type(handle) is not int or not 0 <= handle <= limit:
            return False
    if len(targs) > 1 and len(set(targs)) != len(targs):
        return False
    if kwargs and (not keywords.issuperset(kwargs) or not _scalars(kwargs.values())):
        return False
    if worker is None and signal is None and log is None:
        return True
    return ((worker is None or type(worker) is int and 0 <= worker <= 1 << 20)
            and (signal is None or type(signal) is str and len(signal) <= 256)
            and (log is None or type(log) is int and 0 <= log <= _INT64_MAX))


def _handles(values: list, limit: int) -> bool:
    """Distinct handles: ints in [0, limit]."""
    for handle in values:
        if type(handle) is not int or not 0 <= handle <= limit:
            return False
    return len(values) == 1 or len(set(values)) == len(values)


def _scalars(values) -> bool:
    """All plain scalars: nil, bools, int64s, floats, strings of at most MAX_PLAIN_TEXT."""
    for value in values:
        kind = type(value)
        if kind is int:
            if not _INT64_MIN <= value <= _INT64_MAX:
                return False
        elif kind is str:
            if len(value) > fields.MAX_PLAIN_TEXT:
                return False
        elif not (kind is float or kind is bool or value is None):
            return False
    return True


def _check_carefully(raw, where: str, from_client: bool) -> Instruction:
    if type(raw) is not list or len(raw) != FIELD_COUNT:
        raise MalformedMessage(f"an instruction is a list of {FIELD_COUNT} fields ({', '.join(Instruction._fields)})",
                               where)
    seq, op, outs, args, targs, kwargs, no_grad, requires_grad, worker, signal, log = raw
    fields.integer(seq, f"{where}.seq", 0)
    if type(op) is not str or op not in (CLIENT_OPS if from_client else OPS):
        raise MalformedMessage(f"unknown operation {str(op)[:64]!r}", f"{where}.op")
    spec = OPS[op]
    handle_limit = CLIENT_HANDLES - 1 if from_client else fields.INT64[1]
    fields.integers(outs, f"{where}.outs", spec.results if spec.results is not None else 1024, 0, handle_limit)
    if spec.results is not None and len(outs) != spec.results:
        raise MalformedMessage(f"{op} makes {spec.results} result(s), the instruction names {len(outs)}", f"{where}.outs")
    if spec.results is None and not outs or len(set(outs)) != len(outs):
        raise MalformedMessage("result handles must be distinct, and at least one", f"{where}.outs")
    if op in HANDLE_LISTS:
        fields.integers(args, f"{where}.args", MAX_FREE, 0, handle_limit)
    else:
        for i, arg in enumerate(fields.items(args, f"{where}.args", MAX_ARGS)):
            fields.plain(arg, f"{where}.args[{i}]")
    fields.integers(targs, f"{where}.targs", MAX_ARGS, 0, len(args) - 1)
    fewest, most = spec.inputs
    if not fewest <= len(targs) <= most or len(set(targs)) != len(targs):
        raise MalformedMessage(f"{op} takes {fewest} to {most} distinct tensor arguments, got {len(targs)}",
                               f"{where}.targs")
    for i in targs:
        if type(args[i]) is not int or not 0 <= args[i] <= handle_limit:
            raise MalformedMessage("a tensor argument must be a handle (an integer >= 0)", f"{where}.args[{i}]")
    fields.mapping(kwargs, f"{where}.kwargs", len(spec.kwargs))
    for key, value in kwargs.items():
        if key not in spec.kwargs:
            raise MalformedMessage(f"{op} takes no keyword argument {str(key)[:64]!r} "
                                   f"(it takes: {', '.join(sorted(spec.kwargs)) or 'none'})", f"{where}.kwargs")
        fields.plain(value, f"{where}.kwargs.{key}")
    fields.flag(no_grad, f"{where}.no_grad")
    fields.flag(requires_grad, f"{where}.requires_grad")
    fields.optional(worker, f"{where}.worker", fields.integer, 0, 1 << 20)
    fields.optional(signal, f"{where}.signal", fields.text, 256)
    fields.optional(log, f"{where}.log", fields.integer, 0)
    if op == "upload":
        _check_upload(kwargs, f"{where}.kwargs")
    return Instruction(seq, op, outs, args, targs, kwargs, no_grad, requires_grad, worker, signal, log)


def _check_upload(kwargs: dict, where: str) -> None:
    fields.one_of(kwargs.get("dtype"), f"{where}.dtype", DTYPES)
    fields.integers(kwargs.get("shape"), f"{where}.shape", 64, 0, fields.INT64[1])
    fields.integer(kwargs.get("frame"), f"{where}.frame", 0, MAX_ARGS)


def upload_bytes(instruction: Instruction) -> int:
    """How many bytes an upload's frame must hold."""
    count = 1
    for size in instruction.kwargs["shape"]:
        count *= size
    return count * ITEM_SIZES[instruction.kwargs["dtype"]]


"""How an operation runs on tensors split over workers: the propagation rules.

A tensor's layout on its workers is either *replicated* (every worker holds all of it) or
*split* along one axis (worker i of n holds part i, `torch.tensor_split`'s parts). Given the
layouts of an operation's inputs (already on the workers that run it), `plan` says what each
worker does: which inputs change layout first, which operation it runs, which collective
follows, and how the results are laid out. Nothing here touches a tensor.

One invariant makes the rules compose: a replicated tensor has the same values, and in
backward the same complete gradient, on every worker. So a replicated input that meets split
inputs goes through Megatron's `f` (identity forward, all-reduce backward: each worker saw only
its part, so each holds only part of the gradient), or is split itself when it spans the split
axis; and partial sums (a row-parallel matmul, a reduction over the split axis) are summed by
`g` (all-reduce forward, identity backward). An operation without a rule gathers its split
inputs first and runs replicated: slower, never wrong.

Conversions: ("f",), ("scatter", axis), ("gather", axis), or a list of them applied in order (a
split weight met by split rows is gathered, then enters through f). Random operations on a split
tensor draw each part on its own worker. Post steps: ("g",) all-reduce,
("scale", factor), ("add", position) add an input after the sum (a row-parallel bias).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from paratrain.frontend.ops import OPS, decode_index
from paratrain.frontend.protocol.tensors import part_sizes

# Operations that work element by element on one tensor (or keep every axis where it is).
LOCAL_UNARY = frozenset({
    "neg", "abs", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "silu",
    "gelu", "clamp", "to", "contiguous", "clone", "detach", "zeros_like", "ones_like", "grad",
    "requires_grad_", "set_grad_none",
})
RANDOM = frozenset({"dropout", "randn_like"})


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


@dataclass
class Plan:
    convert: dict = field(default_factory=dict)  # arg position -> conversion (or a list of them)
    op: str | None = None  # None: the instruction's own operation
    args: dict = field(default_factory=dict)  # arg position -> replacement plain value
    kwargs: dict = field(default_factory=dict)  # keyword arguments added or replaced
    replace_kwargs: bool = False  # the replacement op takes only `kwargs`
    post: list = field(default_factory=list)
    outs: list = field(default_factory=list)  # each result's split axis (None: replicated)
    note: str = ""  # what pattern this is, for the instruction log


class Unsupported(Exception):
    """The operation cannot run on these layouts (and gathering would not help)."""


def plan(name: str, args: list, targs: list, kwargs: dict, shapes: dict, splits: dict,
         out_shapes: list, n: int) -> Plan:
    """The plan for `name` on `n` workers. shapes/splits: arg position -> global shape / split
    axis (None: replicated) of each tensor argument; out_shapes: the results' global shapes."""
    results = len(out_shapes)
    if n == 1 or all(splits[i] is None for i in targs):
        if name in RANDOM and n > 1 and not (name == "dropout" and not kwargs.get("training", True)):
            raise Unsupported(f"{name} on a tensor replicated on {n} workers would draw different "
                              "values on each: make the tensor split, or run it on one worker")
        return Plan(outs=[None] * results)
    rule = _RULES.get(name)
    if rule is None and (name in LOCAL_UNARY or name in RANDOM):
        return Plan(outs=[splits[targs[0]]] * results)
    if rule is not None:
        found = rule(args, targs, kwargs, shapes, splits, out_shapes, n)
        if found is not None:
            return found
    if OPS[name].kind == "inplace" or name in ("setitem", "backward", "set_data"):
        raise Unsupported(f"{name} on a tensor split over workers needs every input laid out like it")
    return gather_all(targs, splits, results)


def gather_all(targs, splits, results: int) -> Plan:
    return Plan(convert={i: ("gather", splits[i]) for i in targs if splits[i] is not None},
                outs=[None] * results, note="gathered")


# ---- the rules (each returns a Plan, or None for "no rule: gather") ------------------------------

def _elementwise(args, targs, kwargs, shapes, splits, out_shapes, n):
    out = out_shapes[0]
    target = None
    for i in targs:
        if splits[i] is None:
            continue
        aligned = splits[i] + len(out) - len(shapes[i])
        if shapes[i][splits[i]] != out[aligned] or target not in (None, aligned):
            return None
        target = aligned
    convert = {}
    for i in targs:
        if splits[i] is None:
            axis = target - (len(out) - len(shapes[i]))
            spans = axis >= 0 and shapes[i][axis] == out[target]
            convert[i] = ("scatter", axis) if spans else ("f",)
    return Plan(convert=convert, outs=[target], note="elementwise on parts")


def _inplace(args, targs, kwargs, shapes, splits, out_shapes, n):
    target_split, shape = splits[targs[0]], shapes[targs[0]]
    if target_split is None:
        return Plan(convert={i: ("gather", splits[i]) for i in targs[1:] if splits[i] is not None}, outs=[])
    convert = {}
    for i in targs[1:]:
        aligned = target_split - (len(shape) - len(shapes[i]))
        if splits[i] is not None:
            if splits[i] != aligned:
                return None
        elif aligned >= 0 and shapes[i][aligned] == shape[target_split]:
            convert[i] = ("scatter", aligned)
    return Plan(convert=convert, outs=[], note="in place on parts")


def _softmax(args, targs, kwargs, shapes, splits, out_shapes, n):
    split, dim = splits[0], args[1] % len(shapes[0])
    return None if dim == split else Plan(outs=[split])


def _tril(args, targs, kwargs, shapes, splits, out_shapes, n):
    split = splits[0]
    return None if split >= len(shapes[0]) - 2 else Plan(outs=[split])


def _matmul(args, targs, kwargs, shapes, splits, out_shapes, n):
    a, b = splits[0], splits[1]
    sa, sb, out = shapes[0], shapes[1], out_shapes[0]
    if len(sb) == 2 and len(sa) >= 2:
        last = len(sa) - 1
        if a == last and b == 0:
            return Plan(post=[("g",)], outs=[None], note="row-parallel: partial sums all-reduced")
        if a is None and b == 1:
            return Plan(convert={0: ("f",)}, outs=[len(out) - 1], note="column-parallel: no communication")
        if a is not None and a < last:
            return Plan(convert={1: _whole(b)}, outs=[a + len(out) - len(sa)], note="split rows: weight replicated")
        return None
    if a is not None and b is not None and len(sa) == len(sb) and a == b and a < len(sa) - 2:
        return Plan(outs=[a], note="batched on parts")
    return None


def _linear(args, targs, kwargs, shapes, splits, out_shapes, n):
    x, w = splits[0], splits[1]
    b = splits.get(2)
    last = len(shapes[0]) - 1
    if x is None and w == 1 and b in (None, 0):
        if 2 in splits and b is None:
            return Plan(convert={0: ("f",), 2: ("scatter", 0)}, outs=[last], note="column-parallel: no communication")
        return Plan(convert={0: ("f",)}, outs=[last], note="column-parallel: no communication")
    if x == last and w == 0 and b is None:
        post = [("g",)] + ([("add", 2)] if 2 in splits else [])
        return Plan(args={2: None}, post=post, outs=[None], note="row-parallel: partial sums all-reduced")
    if x is not None and x < last:
        convert = {1: _whole(w)}
        if 2 in splits:
            convert[2] = _whole(b)
        return Plan(convert=convert, outs=[x], note="split rows: weight replicated")
    return None


def _whole(split):
    """A weight used whole by every part of a split input: gathered first if it is split itself
    (its gradient is then summed by f and split again by the gather's backward)."""
    return ("f",) if split is None else [("gather", split), ("f",)]


def _reduce(args, targs, kwargs, shapes, splits, out_shapes, n, name):
    split, shape = splits[0], shapes[0]
    dims = _dims(kwargs.get("dim"), len(shape))
    if split not in dims:
        keep = kwargs.get("keepdim", False)
        return Plan(outs=[split if keep else split - sum(d < split for d in dims)])
    if name not in ("sum", "mean"):
        return None
    post = [("g",)]
    if name == "mean":
        post.append(("scale", 1.0 / math.prod(shape[d] for d in dims)))
    return Plan(op="sum", post=post, outs=[None], note=f"{name} over the split axis: partial sums all-reduced")


def _reshape(args, targs, kwargs, shapes, splits, out_shapes, n):
    split, shape, out = splits[0], shapes[0], out_shapes[0]
    lead = math.prod(shape[:split])
    for axis in range(len(out)):
        if math.prod(out[:axis]) == lead and out[axis] % n == 0 and shape[split] % n == 0 and out[axis] > 0:
            local = list(out)
            local[axis] //= n
            return Plan(args={i + 1: size for i, size in enumerate(local)}, outs=[axis])
        if math.prod(out[:axis]) > lead:
            break
    return None


def _flatten(args, targs, kwargs, shapes, splits, out_shapes, n):
    found = _reshape(args, targs, kwargs, shapes, splits, out_shapes, n)
    if found is None:
        return None
    return Plan(op="reshape", args={i + 1: size for i, size in enumerate(_local(out_shapes[0], found.outs[0], n))},
                replace_kwargs=True, outs=found.outs)


def _local(shape, axis, n):
    local = list(shape)
    local[axis] //= n
    return local


def _transpose(args, targs, kwargs, shapes, splits, out_shapes, n):
    ndim, split = len(shapes[0]), splits[0]
    d0, d1 = args[1] % ndim, args[2] % ndim
    return Plan(outs=[d1 if split == d0 else d0 if split == d1 else split])


def _permute(args, targs, kwargs, shapes, splits, out_shapes, n):
    dims = [d % len(shapes[0]) for d in args[1:]]
    return Plan(outs=[dims.index(splits[0])])


def _unsqueeze(args, targs, kwargs, shapes, splits, out_shapes, n):
    dim = args[1] % (len(shapes[0]) + 1)
    return Plan(outs=[splits[0] + (1 if dim <= splits[0] else 0)])


def _squeeze(args, targs, kwargs, shapes, splits, out_shapes, n):
    shape, split = shapes[0], splits[0]
    dim = kwargs.get("dim")
    removed = [d for d in range(len(shape)) if shape[d] == 1 and (dim is None or d == dim % len(shape))]
    if split in removed:
        return None
    return Plan(outs=[split - sum(d < split for d in removed)])


def _expand(args, targs, kwargs, shapes, splits, out_shapes, n):
    shape, split = shapes[0], splits[0]
    position = 1 + split + len(out_shapes[0]) - len(shape)
    return Plan(args={position: -1}, outs=[split + len(out_shapes[0]) - len(shape)])


def _getitem(args, targs, kwargs, shapes, splits, out_shapes, n):
    if len(targs) > 1:
        return None
    shape, split = shapes[0], splits[0]
    items = list(decode_index(args[1:]))
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = len(shape) - sum(1 for item in items if item is not None and item is not Ellipsis)
        items[at:at + 1] = [slice(None)] * fill
    items += [slice(None)] * (len(shape) - sum(1 for item in items if item is not None))
    axis_in, axis_out = 0, 0
    for item in items:
        if item is None:
            axis_out += 1
            continue
        if axis_in == split:
            full = isinstance(item, slice) and item == slice(None)
            return Plan(outs=[axis_out]) if full else None
        axis_in += 1
        if isinstance(item, slice):
            axis_out += 1
    return None


def _concatenate(args, targs, kwargs, shapes, splits, out_shapes, n, stack=False):
    first = splits[targs[0]]
    if any(splits[i] != first for i in targs):
        return None
    dim = kwargs.get("dim", 0) % (len(shapes[targs[0]]) + (1 if stack else 0))
    if first is None or dim == first:
        return None
    return Plan(outs=[first + (1 if stack and dim <= first else 0)])


def _pieces(args, targs, kwargs, shapes, splits, out_shapes, n):
    dim = kwargs.get("dim", 0) % len(shapes[0])
    return None if dim == splits[0] else Plan(outs=[splits[0]] * len(out_shapes))


def _attention(args, targs, kwargs, shapes, splits, out_shapes, n):
    axis = splits[0]
    if any(splits[i] != axis for i in targs) or axis is None or axis >= len(shapes[0]) - 2:
        return None
    return Plan(outs=[axis], note="attention on whole heads: no communication")


def _layer_norm(args, targs, kwargs, shapes, splits, out_shapes, n):
    x = splits[0]
    normalized = len(args[3])
    if x is None or x >= len(shapes[0]) - normalized:
        return None
    return Plan(convert={i: ("f",) for i in (1, 2) if i in splits}, outs=[x])


def _embedding(args, targs, kwargs, shapes, splits, out_shapes, n):
    idx, weight = splits[0], splits[1]
    if idx is None and weight == 0:
        return Plan(op="vp_embedding", kwargs={"vocab": shapes[1][0]}, replace_kwargs=True, outs=[None],
                    note="vocab-parallel embedding: lookups all-reduced")
    if idx is not None and weight is None:
        return Plan(convert={1: ("f",)}, outs=[idx])
    return None


def _cross_entropy(args, targs, kwargs, shapes, splits, out_shapes, n):
    logits, target = splits[0], splits[1]
    plain = kwargs.get("reduction", "mean") == "mean" and not kwargs.get("label_smoothing")
    if not plain:
        return None
    if logits == len(shapes[0]) - 1 and target is None and len(shapes[0]) == 2:
        return Plan(op="vp_cross_entropy", kwargs={"vocab": shapes[0][-1]}, replace_kwargs=True, outs=[None],
                    note="vocab-parallel cross-entropy: logits never gathered")
    if logits == 0 and target == 0:
        return Plan(kwargs={"reduction": "sum"}, post=[("g",), ("scale", 1.0 / shapes[1][0])], outs=[None],
                    note="split batch: summed losses all-reduced")
    return None


def _mse_loss(args, targs, kwargs, shapes, splits, out_shapes, n):
    if splits[0] is None or splits[0] != splits[1] or kwargs.get("reduction", "mean") != "mean":
        return None
    return Plan(kwargs={"reduction": "sum"}, post=[("g",), ("scale", 1.0 / math.prod(shapes[0]))], outs=[None],
                note="split: summed errors all-reduced")


def _dims(dim, ndim) -> list[int]:
    if dim is None:
        return list(range(ndim))
    return [d % ndim for d in (dim if isinstance(dim, (list, tuple)) else [dim])]


_RULES = {
    **{name: _elementwise for name, op in OPS.items() if op.elementwise},
    "where": _elementwise, "maximum": _elementwise, "minimum": _elementwise, "masked_fill": _elementwise,
    **{name: _inplace for name, op in OPS.items() if op.kind == "inplace" and name != "setitem"},
    "set_grad": _inplace,
    "softmax": _softmax, "log_softmax": _softmax, "tril": _tril, "triu": _tril,
    "matmul": _matmul, "linear": _linear,
    "sum": lambda *a: _reduce(*a, name="sum"), "mean": lambda *a: _reduce(*a, name="mean"),
    "amax": lambda *a: _reduce(*a, name="amax"), "amin": lambda *a: _reduce(*a, name="amin"),
    "reshape": _reshape, "flatten": _flatten, "transpose": _transpose, "permute": _permute,
    "unsqueeze": _unsqueeze, "squeeze": _squeeze, "expand": _expand, "getitem": _getitem,
    "cat": _concatenate, "stack": lambda *a: _concatenate(*a, stack=True), "chunk": _pieces, "split": _pieces,
    "sdpa": _attention, "layer_norm": _layer_norm, "embedding": _embedding,
    "cross_entropy": _cross_entropy, "mse_loss": _mse_loss,
}

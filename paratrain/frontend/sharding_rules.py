"""How an operation runs on tensors split over workers: each operation's propagation rule.

A tensor's layout on its workers is either *replicated* (every worker holds all of it) or
*split* along one axis (worker i of n holds part i, `torch.tensor_split`'s parts). A rule is
given one `SplitCall` (the operation's arguments, the global shape and split axis of each
tensor argument, its results' shapes, the number of workers) and answers with a
`ShardingDecision`: which inputs change layout first (`convert`), which operation each worker
runs, which steps follow (`post`), and how the results are laid out. Nothing here touches a
tensor; the dispatcher carries decisions out (`dispatcher/compute.py`).

Which rule an operation follows is written on its entry in `ops.py`. A rule answers None for
"no rule for these layouts": its split inputs are gathered first and it runs replicated, slower,
never wrong. A rule raises `Unsupported` where gathering would be wrong (an in-place change of
a split tensor must stay on its parts).

One invariant makes the rules compose: a replicated tensor has the same values, and in
backward the same complete gradient, on every worker. So a replicated input that meets split
inputs enters through Megatron's `f` (identity forward, all-reduce backward: each worker saw
only its part, so each holds only part of the gradient), or is scattered itself when it spans
the split axis; and partial sums (a row-parallel matmul, a reduction over the split axis) are
summed by `g` (all-reduce forward, identity backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from paratrain.frontend.indexing import decode_index


class Unsupported(Exception):
    """The operation cannot run on these layouts (and gathering would not help)."""


# ---- conversions: an input's layout changed before the operation ---------------------------------

@dataclass(frozen=True)
class EnterF:
    """Megatron's f: the replicated tensor as it is, its gradient all-reduced in backward."""


@dataclass(frozen=True)
class Scatter:
    """Each worker keeps its part of a replicated tensor along `axis`."""
    axis: int


@dataclass(frozen=True)
class Gather:
    """The parts along `axis` joined into the whole tensor on every worker."""
    axis: int


# ---- post-steps: what follows an operation that made a partial result -----------------------------

@dataclass(frozen=True)
class AllReduce:
    """Megatron's g: the workers' partial sums summed (identity in backward)."""


@dataclass(frozen=True)
class Scale:
    factor: float


@dataclass(frozen=True)
class AddInput:
    """Add the operation's input at `position` after the sum (a row-parallel bias)."""
    position: int


class SplitCall(NamedTuple):
    """One operation on inputs of which some are split: what a rule decides from."""
    name: str
    args: list
    targs: list
    kwargs: dict
    shapes: dict  # arg position -> the tensor's global shape
    splits: dict  # arg position -> its split axis (None: replicated)
    out_shapes: list  # the results' global shapes
    n: int  # workers


@dataclass
class ShardingDecision:
    """What each worker does for one operation on split inputs."""
    convert: dict = field(default_factory=dict)  # arg position -> conversions, applied in order
    op: str | None = None  # None: the instruction's own operation
    args: dict = field(default_factory=dict)  # arg position -> replacement plain value
    kwargs: dict = field(default_factory=dict)  # keyword arguments added or replaced
    replace_kwargs: bool = False  # the replacement op takes only `kwargs`
    post: tuple = ()  # post-steps, in order, on the (one) result
    outs: list = field(default_factory=list)  # each result's split axis (None: replicated)
    note: str = ""  # what pattern this is, for the instruction log


# ---- the rules ----------------------------------------------------------------------------------

def keep_layout(call: SplitCall) -> ShardingDecision:
    """Element by element on one tensor (or every axis kept where it is): each part alone."""
    return ShardingDecision(outs=[call.splits[call.targs[0]]] * len(call.out_shapes))


def same_layout_only(call: SplitCall) -> None:
    """It changes a tensor, or acts on it whole: gathering a copy first would be wrong."""
    raise Unsupported(f"{call.name} on a tensor split over workers needs every input laid out like it")


def elementwise(call: SplitCall) -> ShardingDecision | None:
    shapes, splits, out = call.shapes, call.splits, call.out_shapes[0]
    target = None
    for i in call.targs:
        if splits[i] is None:
            continue
        aligned = splits[i] + len(out) - len(shapes[i])
        if shapes[i][splits[i]] != out[aligned] or target not in (None, aligned):
            return None
        target = aligned
    convert = {}
    for i in call.targs:
        if splits[i] is None:
            axis = target - (len(out) - len(shapes[i]))
            spans = axis >= 0 and shapes[i][axis] == out[target]
            convert[i] = (Scatter(axis),) if spans else (EnterF(),)
    return ShardingDecision(convert=convert, outs=[target], note="elementwise on parts")


def like_first_input(call: SplitCall) -> ShardingDecision | None:
    """The other inputs laid out like the first, which the operation changes (set_grad)."""
    targs, shapes, splits = call.targs, call.shapes, call.splits
    target_split, shape = splits[targs[0]], shapes[targs[0]]
    if target_split is None:
        return ShardingDecision(convert={i: (Gather(splits[i]),) for i in targs[1:] if splits[i] is not None}, outs=[])
    convert = {}
    for i in targs[1:]:
        aligned = target_split - (len(shape) - len(shapes[i]))
        if splits[i] is not None:
            if splits[i] != aligned:
                return None
        elif aligned >= 0 and shapes[i][aligned] == shape[target_split]:
            convert[i] = (Scatter(aligned),)
    return ShardingDecision(convert=convert, outs=[], note="in place on parts")


def in_place(call: SplitCall) -> ShardingDecision:
    """An in-place operation runs on the parts of the tensor it changes, or not at all."""
    return like_first_input(call) or same_layout_only(call)


def softmax(call: SplitCall) -> ShardingDecision | None:
    split, dim = call.splits[0], call.args[1] % len(call.shapes[0])
    return None if dim == split else ShardingDecision(outs=[split])


def triangle(call: SplitCall) -> ShardingDecision | None:
    split = call.splits[0]
    return None if split >= len(call.shapes[0]) - 2 else ShardingDecision(outs=[split])


def matmul(call: SplitCall) -> ShardingDecision | None:
    a, b = call.splits[0], call.splits[1]
    sa, sb, out = call.shapes[0], call.shapes[1], call.out_shapes[0]
    if len(sb) == 2 and len(sa) >= 2:
        last = len(sa) - 1
        if a == last and b == 0:
            return ShardingDecision(post=(AllReduce(),), outs=[None], note="row-parallel: partial sums all-reduced")
        if a is None and b == 1:
            return ShardingDecision(convert={0: (EnterF(),)}, outs=[len(out) - 1],
                                    note="column-parallel: no communication")
        if a is not None and a < last:
            return ShardingDecision(convert={1: _whole(b)}, outs=[a + len(out) - len(sa)],
                                    note="split rows: weight replicated")
        return None
    if a is not None and b is not None and len(sa) == len(sb) and a == b and a < len(sa) - 2:
        return ShardingDecision(outs=[a], note="batched on parts")
    return None


def linear(call: SplitCall) -> ShardingDecision | None:
    splits = call.splits
    x, w, b = splits[0], splits[1], splits.get(2)
    last = len(call.shapes[0]) - 1
    if x is None and w == 1 and b in (None, 0):
        convert = {0: (EnterF(),)}
        if 2 in splits and b is None:
            convert[2] = (Scatter(0),)
        return ShardingDecision(convert=convert, outs=[last], note="column-parallel: no communication")
    if x == last and w == 0 and b is None:
        post = (AllReduce(), AddInput(2)) if 2 in splits else (AllReduce(),)
        return ShardingDecision(args={2: None}, post=post, outs=[None], note="row-parallel: partial sums all-reduced")
    if x is not None and x < last:
        convert = {1: _whole(w)}
        if 2 in splits:
            convert[2] = _whole(b)
        return ShardingDecision(convert=convert, outs=[x], note="split rows: weight replicated")
    return None


def _whole(split) -> tuple:
    """A weight used whole by every part of a split input: gathered first if it is split itself
    (its gradient is then summed by f and split again by the gather's backward)."""
    return (EnterF(),) if split is None else (Gather(split), EnterF())


def _reduction(call: SplitCall, summed: bool) -> ShardingDecision | None:
    """Over other axes: on parts. Over the split axis: partial sums all-reduced, if the
    reduction is a sum (or a mean: a sum scaled)."""
    split, shape, kwargs = call.splits[0], call.shapes[0], call.kwargs
    dims = _dims(kwargs.get("dim"), len(shape))
    if split not in dims:
        keep = kwargs.get("keepdim", False)
        return ShardingDecision(outs=[split if keep else split - sum(d < split for d in dims)])
    if not summed:
        return None
    post = (AllReduce(),)
    if call.name == "mean":
        post += (Scale(1.0 / math.prod(shape[d] for d in dims)),)
    return ShardingDecision(op="sum", post=post, outs=[None],
                            note=f"{call.name} over the split axis: partial sums all-reduced")


def sum_or_mean(call: SplitCall) -> ShardingDecision | None:
    return _reduction(call, summed=True)


def extreme(call: SplitCall) -> ShardingDecision | None:
    """amax, amin: split only along an axis they do not reduce."""
    return _reduction(call, summed=False)


def reshape(call: SplitCall) -> ShardingDecision | None:
    split, shape, out, n = call.splits[0], call.shapes[0], call.out_shapes[0], call.n
    lead = math.prod(shape[:split])
    for axis in range(len(out)):
        if math.prod(out[:axis]) == lead and out[axis] % n == 0 and shape[split] % n == 0 and out[axis] > 0:
            local = list(out)
            local[axis] //= n
            return ShardingDecision(args={i + 1: size for i, size in enumerate(local)}, outs=[axis])
        if math.prod(out[:axis]) > lead:
            break
    return None


def flatten(call: SplitCall) -> ShardingDecision | None:
    found = reshape(call)
    if found is None:
        return None
    local = list(call.out_shapes[0])
    local[found.outs[0]] //= call.n
    return ShardingDecision(op="reshape", args={i + 1: size for i, size in enumerate(local)},
                            replace_kwargs=True, outs=found.outs)


def transpose(call: SplitCall) -> ShardingDecision:
    ndim, split = len(call.shapes[0]), call.splits[0]
    d0, d1 = call.args[1] % ndim, call.args[2] % ndim
    return ShardingDecision(outs=[d1 if split == d0 else d0 if split == d1 else split])


def permute(call: SplitCall) -> ShardingDecision:
    dims = [d % len(call.shapes[0]) for d in call.args[1:]]
    return ShardingDecision(outs=[dims.index(call.splits[0])])


def unsqueeze(call: SplitCall) -> ShardingDecision:
    split = call.splits[0]
    dim = call.args[1] % (len(call.shapes[0]) + 1)
    return ShardingDecision(outs=[split + (1 if dim <= split else 0)])


def squeeze(call: SplitCall) -> ShardingDecision | None:
    shape, split, dim = call.shapes[0], call.splits[0], call.kwargs.get("dim")
    removed = [d for d in range(len(shape)) if shape[d] == 1 and (dim is None or d == dim % len(shape))]
    if split in removed:
        return None
    return ShardingDecision(outs=[split - sum(d < split for d in removed)])


def expand(call: SplitCall) -> ShardingDecision:
    shape, split, added = call.shapes[0], call.splits[0], len(call.out_shapes[0]) - len(call.shapes[0])
    return ShardingDecision(args={1 + split + added: -1}, outs=[split + added])


def getitem(call: SplitCall) -> ShardingDecision | None:
    if len(call.targs) > 1:
        return None
    shape, split = call.shapes[0], call.splits[0]
    items = list(decode_index(call.args[1:]))
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
            return ShardingDecision(outs=[axis_out]) if full else None
        axis_in += 1
        if isinstance(item, slice):
            axis_out += 1
    return None


def _joined(call: SplitCall, stack: bool) -> ShardingDecision | None:
    targs, splits = call.targs, call.splits
    first = splits[targs[0]]
    if any(splits[i] != first for i in targs):
        return None
    dim = call.kwargs.get("dim", 0) % (len(call.shapes[targs[0]]) + (1 if stack else 0))
    if first is None or dim == first:
        return None
    return ShardingDecision(outs=[first + (1 if stack and dim <= first else 0)])


def concatenate(call: SplitCall) -> ShardingDecision | None:
    return _joined(call, stack=False)


def stack(call: SplitCall) -> ShardingDecision | None:
    return _joined(call, stack=True)


def pieces(call: SplitCall) -> ShardingDecision | None:
    """chunk, split: cut along another axis than the split one, each part cuts its own."""
    dim = call.kwargs.get("dim", 0) % len(call.shapes[0])
    return None if dim == call.splits[0] else ShardingDecision(outs=[call.splits[0]] * len(call.out_shapes))


def attention(call: SplitCall) -> ShardingDecision | None:
    axis = call.splits[0]
    if any(call.splits[i] != axis for i in call.targs) or axis is None or axis >= len(call.shapes[0]) - 2:
        return None
    return ShardingDecision(outs=[axis], note="attention on whole heads: no communication")


def layer_norm(call: SplitCall) -> ShardingDecision | None:
    x, normalized = call.splits[0], len(call.args[3])
    if x is None or x >= len(call.shapes[0]) - normalized:
        return None
    return ShardingDecision(convert={i: (EnterF(),) for i in (1, 2) if i in call.splits}, outs=[x])


def embedding(call: SplitCall) -> ShardingDecision | None:
    idx, weight = call.splits[0], call.splits[1]
    if idx is None and weight == 0:
        return ShardingDecision(op="vp_embedding", kwargs={"vocab": call.shapes[1][0]}, replace_kwargs=True,
                                outs=[None], note="vocab-parallel embedding: lookups all-reduced")
    if idx is not None and weight is None:
        return ShardingDecision(convert={1: (EnterF(),)}, outs=[idx])
    return None


def cross_entropy(call: SplitCall) -> ShardingDecision | None:
    logits, target = call.splits[0], call.splits[1]
    shapes, kwargs = call.shapes, call.kwargs
    if kwargs.get("reduction", "mean") != "mean" or kwargs.get("label_smoothing"):
        return None
    if logits == len(shapes[0]) - 1 and target is None and len(shapes[0]) == 2:
        return ShardingDecision(op="vp_cross_entropy", kwargs={"vocab": shapes[0][-1]}, replace_kwargs=True,
                                outs=[None], note="vocab-parallel cross-entropy: logits never gathered")
    if logits == 0 and target == 0:
        return ShardingDecision(kwargs={"reduction": "sum"}, post=(AllReduce(), Scale(1.0 / shapes[1][0])),
                                outs=[None], note="split batch: summed losses all-reduced")
    return None


def mse_loss(call: SplitCall) -> ShardingDecision | None:
    splits = call.splits
    if splits[0] is None or splits[0] != splits[1] or call.kwargs.get("reduction", "mean") != "mean":
        return None
    return ShardingDecision(kwargs={"reduction": "sum"}, post=(AllReduce(), Scale(1.0 / math.prod(call.shapes[0]))),
                            outs=[None], note="split: summed errors all-reduced")


def _dims(dim, ndim) -> list[int]:
    if dim is None:
        return list(range(ndim))
    return [d % ndim for d in (dim if isinstance(dim, (list, tuple)) else [dim])]

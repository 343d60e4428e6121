"""Every operation the frontend can run, in one table.

The same entry serves three places: the client runs `fn` on meta tensors to infer the
result's shape and dtype at the line that made it (`shapes.py`), the protocol checks an
instruction against it (a known name, allowed keyword arguments, as many tensor inputs and
results as the operation takes), and a worker runs `fn` on real tensors. So a shape the client
predicts is the shape the worker produces, by construction.

Operations whose `fn` is None are run by the worker's own handlers (`workers/handlers.py`):
uploads, autograd, optimizers. Those of kind "internal" only the dispatcher may ask for
(moving tensors between workers, the collectives of sharded execution); a client naming one is
refused.

Each entry also carries the operation's traits (random, in place, autograd state, ...) and its
sharding rule (`sharding_rules.py`): every module that treats a kind of operation apart reads
it here, never from a list of names of its own. The dtypes are listed here once, too.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from paratrain.frontend import sharding_rules as rules
from paratrain.frontend.indexing import decode_index

TORCH_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
DTYPES = tuple(TORCH_DTYPES)  # every dtype a tensor of the frontend can have, by name
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
ITEM_SIZES = {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()}
FLOATING = frozenset(name for name, dtype in TORCH_DTYPES.items() if dtype.is_floating_point)


def torch_dtype(name: str | None, default: torch.dtype | None = None) -> torch.dtype | None:
    if name is None:
        return default
    if name not in TORCH_DTYPES:
        raise TypeError(f"unknown dtype {name!r}; valid: {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


MANY = 1 << 16  # "any number": tensors in a cat, parameters of an optimizer


@dataclass(frozen=True)
class Op:
    fn: Callable | None  # None: a worker handler implements it (uploads, autograd, optimizers)
    kwargs: frozenset = frozenset()
    kind: str = "compute"  # compute | create | inplace | special | internal (dispatcher only)
    differentiable: bool = True
    elementwise: bool = False  # a scalar operand changes only the dtype: shapes cache by its type
    inputs: tuple[int, int] = (1, 1)  # (fewest, most) tensor arguments
    results: int | None = 1  # result handles; None: as many as it makes (chunk, split)
    # Draws from a random generator: replicas would differ, compiled code draws other numbers.
    # An operation with a `training` keyword (dropout) draws only when training.
    random: bool = False
    # Touches only autograd's state: no shape to infer, its result (if any) is the tensor itself.
    autograd_state: bool = False
    # Acts on its first input: runs where that lives, whatever signal is active.
    stays_with_input: bool = False
    changes_input: bool = False  # its first input changes (a copy made of it no longer equals it)
    # Created from a range, not a shape: its parts cannot be made apart, so it is never split
    # when created (the other creations take the shape as their arguments, and each worker
    # makes its own part).
    created_whole: bool = False
    # Its rule on inputs split over workers (sharding_rules.py); None: they are gathered first.
    sharding: Callable | None = None

    @property
    def collective(self) -> bool:
        """It runs a collective over the workers its `g` keyword names (dispatcher-only ops)."""
        return "g" in self.kwargs


def _op(fn, *kwargs, **options) -> Op:
    kind = options.get("kind")
    if kind == "create":
        options.setdefault("inputs", (0, 0))
    elif kind == "inplace":
        options.setdefault("results", 0)
        options.setdefault("stays_with_input", True)
        options.setdefault("changes_input", True)
        options.setdefault("sharding", rules.in_place)
    return Op(fn, frozenset(kwargs), **options)


def _local(fn, *kwargs, **options) -> Op:
    """An operation on each element of one tensor (or one that keeps every axis in place): a
    split tensor's parts each run it alone."""
    return _op(fn, *kwargs, sharding=rules.keep_layout, **options)


def _getitem(x, *items):
    return x[decode_index(items)]


def _setitem(x, value, *items):
    x[decode_index(items)] = value


def _dims(dim):
    return tuple(dim) if isinstance(dim, list) else dim


def _reduce(method: str):
    def run(x, dim=None, keepdim=False):
        if dim is None:
            return getattr(x, method)()
        return getattr(x, method)(_dims(dim), keepdim=keepdim)
    return run


def _max_with_indices(x, dim, keepdim=False):
    values, indices = torch.max(x, dim, keepdim=keepdim)
    return values, indices


def _min_with_indices(x, dim, keepdim=False):
    values, indices = torch.min(x, dim, keepdim=keepdim)
    return values, indices


def _creation(make):
    """A creation op: `make(shape, dtype, device, **kwargs)`; the shape arrives as the args."""
    def run(*shape, dtype=None, device="cpu", **kwargs):
        return make(tuple(shape), torch_dtype(dtype, torch.float32), device, **kwargs)
    return run


def _to(x, dtype):
    return x.to(torch_dtype(dtype))


def _layer_norm(x, weight, bias, normalized_shape, eps=1e-5):
    return F.layer_norm(x, tuple(normalized_shape), weight, bias, eps)


_BINARY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "pow": operator.pow, "mod": operator.mod,
}
_COMPARE = {
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "eq": operator.eq, "ne": operator.ne,
}
_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "relu": torch.relu, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "sin": torch.sin, "cos": torch.cos, "silu": F.silu,
}

_CHANGES_AUTOGRAD_STATE = {"autograd_state": True, "stays_with_input": True, "changes_input": True}

OPS: dict[str, Op] = {
    **{name: _op(fn, elementwise=True, inputs=(1, 2), sharding=rules.elementwise) for name, fn in _BINARY.items()},
    **{name: _op(fn, elementwise=True, differentiable=False, inputs=(1, 2), sharding=rules.elementwise)
       for name, fn in _COMPARE.items()},
    **{name: _local(fn) for name, fn in _UNARY.items()},
    "maximum": _op(torch.maximum, inputs=(1, 2), sharding=rules.elementwise),
    "minimum": _op(torch.minimum, inputs=(1, 2), sharding=rules.elementwise),
    "where": _op(torch.where, inputs=(1, 3), sharding=rules.elementwise),
    "gelu": _local(F.gelu, "approximate"),
    "softmax": _op(lambda x, dim: torch.softmax(x, dim), sharding=rules.softmax),
    "log_softmax": _op(lambda x, dim: torch.log_softmax(x, dim), sharding=rules.softmax),
    "clamp": _local(torch.clamp, "min", "max"),
    "to": _local(_to),
    "tril": _op(torch.tril, "diagonal", sharding=rules.triangle),
    "triu": _op(torch.triu, "diagonal", sharding=rules.triangle),
    "masked_fill": _op(torch.Tensor.masked_fill, inputs=(2, 3), sharding=rules.elementwise),
    "dropout": _local(F.dropout, "p", "training", random=True),
    "matmul": _op(torch.matmul, inputs=(2, 2), sharding=rules.matmul),
    # x @ weight + bias for a weight stored [in, out] (GT's layout), as one fused addmm
    "linear": _op(lambda x, weight, bias=None: F.linear(x, weight.t(), bias), inputs=(2, 3), sharding=rules.linear),
    # reductions (dim=None reduces everything)
    "sum": _op(_reduce("sum"), "dim", "keepdim", sharding=rules.sum_or_mean),
    "mean": _op(_reduce("mean"), "dim", "keepdim", sharding=rules.sum_or_mean),
    "amax": _op(_reduce("amax"), "dim", "keepdim", sharding=rules.extreme),
    "amin": _op(_reduce("amin"), "dim", "keepdim", sharding=rules.extreme),
    "max_all": _op(torch.max), "min_all": _op(torch.min),
    "max": _op(_max_with_indices, "keepdim", results=2), "min": _op(_min_with_indices, "keepdim", results=2),
    "argmax": _op(torch.argmax, "dim", "keepdim", differentiable=False),
    "var": _op(lambda x, dim=None, keepdim=False, correction=1: torch.var(x, _dims(dim), correction=correction, keepdim=keepdim), "dim", "keepdim", "correction"),
    # shapes
    "reshape": _op(lambda x, *shape: x.reshape(shape), sharding=rules.reshape),
    "transpose": _op(torch.transpose, sharding=rules.transpose),
    "permute": _op(lambda x, *dims: x.permute(dims), sharding=rules.permute),
    "unsqueeze": _op(torch.unsqueeze, sharding=rules.unsqueeze),
    "squeeze": _op(lambda x, dim=None: x.squeeze() if dim is None else x.squeeze(dim), "dim", sharding=rules.squeeze),
    "flatten": _op(torch.flatten, "start_dim", "end_dim", sharding=rules.flatten),
    "expand": _op(lambda x, *shape: x.expand(shape), sharding=rules.expand),
    "contiguous": _local(torch.Tensor.contiguous), "clone": _local(torch.clone),
    "detach": _local(torch.Tensor.detach, differentiable=False, stays_with_input=True),
    "cat": _op(lambda *xs, dim=0: torch.cat(xs, dim), "dim", inputs=(1, MANY), sharding=rules.concatenate),
    "stack": _op(lambda *xs, dim=0: torch.stack(xs, dim), "dim", inputs=(1, MANY), sharding=rules.stack),
    "chunk": _op(torch.chunk, "dim", results=None, sharding=rules.pieces),
    "split": _op(torch.split, "dim", results=None, sharding=rules.pieces),
    "getitem": _op(_getitem, inputs=(1, MANY), sharding=rules.getitem),
    # neural-network functions
    "cross_entropy": _op(F.cross_entropy, "ignore_index", "reduction", "label_smoothing", inputs=(2, 2),
                         sharding=rules.cross_entropy),
    "mse_loss": _op(F.mse_loss, "reduction", inputs=(2, 2), sharding=rules.mse_loss),
    "embedding": _op(lambda indices, weight: F.embedding(indices, weight), inputs=(2, 2), sharding=rules.embedding),
    "layer_norm": _op(_layer_norm, "eps", inputs=(1, 3), sharding=rules.layer_norm),
    "sdpa": _op(F.scaled_dot_product_attention, "is_causal", "scale", inputs=(3, 3), sharding=rules.attention),
    "zeros_like": _local(torch.zeros_like, differentiable=False),
    "ones_like": _local(torch.ones_like, differentiable=False),
    "randn_like": _local(torch.randn_like, differentiable=False, random=True),
    # in place: no result handle, the first argument changes
    "add_": _op(torch.Tensor.add_, kind="inplace", inputs=(1, 2)),
    "sub_": _op(torch.Tensor.sub_, kind="inplace", inputs=(1, 2)),
    "mul_": _op(torch.Tensor.mul_, kind="inplace", inputs=(1, 2)),
    "div_": _op(torch.Tensor.div_, kind="inplace", inputs=(1, 2)),
    "pow_": _op(torch.Tensor.pow_, kind="inplace", inputs=(1, 2)),
    "zero_": _op(torch.Tensor.zero_, kind="inplace"),
    "fill_": _op(torch.Tensor.fill_, kind="inplace", inputs=(1, 2)),
    "copy_": _op(torch.Tensor.copy_, kind="inplace", inputs=(2, 2)),
    "clamp_": _op(torch.Tensor.clamp_, "min", "max", kind="inplace"),
    "masked_fill_": _op(torch.Tensor.masked_fill_, kind="inplace", inputs=(2, 3)),
    "setitem": _op(_setitem, kind="inplace", inputs=(1, MANY), sharding=rules.same_layout_only),
    # creation: placed where the client's context says; the worker passes `device`
    "randn": _op(_creation(lambda s, dt, dev: torch.randn(s, dtype=dt, device=dev)), "dtype", kind="create", random=True),
    "rand": _op(_creation(lambda s, dt, dev: torch.rand(s, dtype=dt, device=dev)), "dtype", kind="create", random=True),
    "zeros": _op(_creation(lambda s, dt, dev: torch.zeros(s, dtype=dt, device=dev)), "dtype", kind="create"),
    "ones": _op(_creation(lambda s, dt, dev: torch.ones(s, dtype=dt, device=dev)), "dtype", kind="create"),
    "full": _op(_creation(lambda s, dt, dev, value: torch.full(s, value, dtype=dt, device=dev)), "dtype", "value", kind="create"),
    "uniform": _op(_creation(lambda s, dt, dev, low, high: torch.empty(s, dtype=dt, device=dev).uniform_(low, high)),
                   "dtype", "low", "high", kind="create", random=True),
    "randint": _op(_creation(lambda s, dt, dev, low, high: torch.randint(low, high, s, device=dev)),
                   "dtype", "low", "high", kind="create", random=True),
    "arange": _op(lambda start, end, step, dtype=None, device="cpu":
                  torch.arange(start, end, step, dtype=torch_dtype(dtype), device=device),
                  "dtype", kind="create", created_whole=True),
    # run by the worker's handlers
    "upload": _op(None, "dtype", "shape", "frame", kind="special", inputs=(0, 0)),
    "free": _op(None, kind="special", inputs=(0, 0), results=0),
    "keep_grads": _op(None, kind="special", inputs=(0, 0), results=0),  # GT: results keep .grad
    "backward": _op(None, "retain_graph", "local", kind="special", inputs=(1, 2), results=0, autograd_state=True,
                    sharding=rules.same_layout_only),
    "cross_backward": _op(None, kind="special", results=0, autograd_state=True),  # a pipeline stage's share of backward
    "reshard": _op(None, "signal", "backward", kind="special"),  # gt.signal.tensor
    "grad": _local(None, kind="special", autograd_state=True, stays_with_input=True),
    "set_grad_none": _local(None, kind="special", results=0, **_CHANGES_AUTOGRAD_STATE),
    "set_grad": _op(None, kind="special", inputs=(2, 2), results=0, sharding=rules.like_first_input,
                    **_CHANGES_AUTOGRAD_STATE),
    "set_data": _op(None, kind="special", inputs=(2, 2), results=0, sharding=rules.same_layout_only,
                    **_CHANGES_AUTOGRAD_STATE),
    "requires_grad_": _local(None, kind="special", results=0, **_CHANGES_AUTOGRAD_STATE),
    "optim_create": _op(None, "kind", "lr", "momentum", "weight_decay", "betas", "eps", "nesterov", "dampening",
                        kind="special", inputs=(1, MANY)),
    "optim_step": _op(None, kind="special", results=0),
    "optim_zero_grad": _op(None, "set_to_none", kind="special", results=0),
    "optim_set_lr": _op(None, "lr", kind="special", results=0),
    "manual_seed": _op(None, kind="special", inputs=(0, 0), results=0),
    # where a compiled region (a signal with compile: true) begins and ends; the client marks
    # them, the dispatcher tells each worker that runs part of the region (workers/compiled.py)
    "region_begin": _op(None, "name", kind="special", inputs=(0, 0), results=0),
    "region_end": _op(None, "name", kind="special", inputs=(0, 0), results=0),
    # only the dispatcher asks for these (see workers/crossings.py and workers/collectives.py)
    "send": _op(None, "to", "crossing", kind="internal", results=0),
    "recv": _op(None, "src", "crossing", kind="internal", inputs=(0, 0)),
    "bw_send": _op(None, "crossing", "to", "parts", "axis", "retain", kind="internal", inputs=(0, 0), results=0),
    "bw_recv": _op(None, "crossing", "src", "retain", "gather", "axis", "length", kind="internal",
                   inputs=(0, 0), results=0),
    "release": _op(None, kind="internal", inputs=(0, 0), results=0),
    "twin_copy": _op(None, "crossing", kind="internal", results=0),
    "twin_source": _op(None, "crossing", kind="internal", results=0),
    "twin_bw_send": _op(None, "crossing", "to", kind="internal", inputs=(0, 0), results=0),
    "twin_bw_recv": _op(None, "crossing", "src", "axis", "part", "retain", kind="internal", inputs=(0, 0), results=0),
    "make_group": _op(None, "g", kind="internal", inputs=(0, 0), results=0),
    "tp_f": _op(None, "g", kind="internal"),
    "tp_g": _op(None, "g", kind="internal"),
    "tp_scatter": _op(None, "g", "axis", kind="internal"),
    "tp_gather": _op(None, "g", "axis", "length", kind="internal"),
    "tp_broadcast": _op(None, "g", "shape", "dtype", kind="internal", inputs=(0, 0)),
    "vp_embedding": _op(None, "g", "vocab", kind="internal", inputs=(2, 2)),
    "vp_cross_entropy": _op(None, "g", "vocab", kind="internal", inputs=(2, 2)),
    "alias": _op(None, kind="internal"),
}
HANDLE_LISTS = frozenset({"free", "release", "keep_grads"})  # their arguments are all handles
CLIENT_OPS = frozenset(name for name, op in OPS.items() if op.kind != "internal")


def validate_kwargs(name: str, kwargs: dict) -> str | None:
    """None if `kwargs` suit op `name`, else a one-line reason."""
    op = OPS[name]
    unknown = set(kwargs) - op.kwargs
    if unknown:
        return f"{name}: unexpected keyword argument(s) {', '.join(sorted(map(str, unknown)))}"
    return None

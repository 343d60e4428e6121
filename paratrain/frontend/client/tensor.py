"""The client's tensor: a handle, a shape and a dtype. The values live on a worker.

Every method issues one instruction (see `Session.call`) and returns at once; only the sync
points (`item`, `numpy`, `tolist`, `print`, `float`, `bool`...) wait for the workers. Shapes
are always known here, so `.shape` never waits.

The client keeps a thin copy of the autograd graph (`autograd.Node`: which inputs that require
grad each result came from) to know after `backward()` which tensors have a gradient. The graph
itself lives on the workers.
"""

from __future__ import annotations

import weakref

import numpy as np

from paratrain.frontend.client.arguments import dim_or_axis, keep_dims, shape_args
from paratrain.frontend.client.autograd import Node, no_grad, run_backward
from paratrain.frontend.client.dtypes import dtype_named, floating
from paratrain.frontend.indexing import encode_index
from paratrain.frontend.ops import DTYPES


class Tensor:
    __slots__ = ("_session", "_handle", "shape", "dtype", "_requires_grad", "_node",
                 "_has_grad", "_grad_tensor", "__weakref__")

    def __init__(self, session, handle: int, shape: tuple, dtype: str, requires_grad: bool = False):
        self._session, self._handle = session, handle
        self.shape, self.dtype = tuple(shape), dtype_named(dtype)
        self._requires_grad = requires_grad
        self._node: Node | None = None  # made when it first takes part in a graph
        self._has_grad = False
        self._grad_tensor: Tensor | None = None

    def __del__(self):
        try:
            self._session.free(self._handle)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to free
            pass

    # ---- what it is -----------------------------------------------------------------------

    def __repr__(self):
        values = np.array2string(self.numpy(), separator=", ", prefix="tensor(")
        extra = f", dtype={self.dtype}" if self.dtype != "float32" else ""
        return f"tensor({values}{extra}{', requires_grad=True' if self.requires_grad else ''})"

    __str__ = __repr__

    def __format__(self, spec):
        return format(self.item(), spec) if self.numel() == 1 else format(str(self), spec)

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    __hash__ = object.__hash__

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def is_leaf(self) -> bool:
        return self._node is None or not self._node.inputs

    # ---- values (sync points) ---------------------------------------------------------------

    def numpy(self) -> np.ndarray:
        (value,) = self._session.sync([self._handle])
        return value

    def item(self):
        if self.numel() != 1:
            raise ValueError(f"item() needs a tensor with one element, this one has shape {list(self.shape)}")
        return self.numpy().reshape(()).item()

    def tolist(self):
        return self.numpy().tolist()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __bool__(self):
        return bool(self.item())

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value.astype(dtype) if dtype is not None else value

    def __array_function__(self, func, types, args, kwargs):
        """NumPy's functions (`np.mean(t)`, `np.concatenate([a, b])`) run on the values: a sync."""
        return func(*_values(args), **_values(kwargs))

    @property
    def id(self) -> int:
        """GT's tensor id: this tensor's handle in its session."""
        return self._handle

    # ---- autograd ---------------------------------------------------------------------------

    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        self.requires_grad_(flag)

    def requires_grad_(self, flag: bool = True) -> Tensor:
        if not self.is_leaf and not flag:
            raise RuntimeError("requires_grad can only be switched off on leaf tensors (use detach())")
        if flag and not floating(self.dtype):
            raise RuntimeError(f"only floating-point tensors can require gradients, this one is {self.dtype}")
        self._session.issue("requires_grad_", [], [self._handle, bool(flag)], [0], tensors=(self,))
        self._requires_grad = bool(flag)
        return self

    def backward(self, gradient: Tensor | None = None, retain_graph: bool = False) -> None:
        if not self.requires_grad:
            raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
        if gradient is None and self.numel() != 1:
            raise RuntimeError(f"grad can be implicitly created only for scalar outputs (shape {list(self.shape)})")
        args = [self._handle] if gradient is None else [self._handle, gradient._handle]
        kwargs = {"retain_graph": True} if retain_graph else {}
        run_backward(self, args, kwargs, keep_graph=retain_graph)

    def retain_grad(self) -> None:
        """PyTorch's name; every result keeps its gradient here already (GT's rule)."""

    @property
    def _grad(self) -> Tensor | None:
        """GT's programs (and its tests) read `_grad`; it is `.grad`."""
        return self.grad

    @property
    def grad(self) -> Tensor | None:
        if not self._has_grad:
            return None
        if self._grad_tensor is None:
            self._grad_tensor = Tensor(self._session, self._session.new_handle(), self.shape, self.dtype)
            self._session.issue("grad", [self._grad_tensor._handle], [self._handle], [0], tensors=(self,))
        return self._grad_tensor

    @grad.setter
    def grad(self, value) -> None:
        if value is None:
            self._session.issue("set_grad_none", [], [self._handle], [0], tensors=(self,))
            self._has_grad, self._grad_tensor = False, None
            return
        if not isinstance(value, Tensor) or value.shape != self.shape or value.dtype != self.dtype:
            raise RuntimeError(f"assigned grad must be a tensor of shape {list(self.shape)} and dtype {self.dtype}")
        self._session.issue("set_grad", [], [self._handle, value._handle], [0, 1], tensors=(self, value))
        self._has_grad, self._grad_tensor = True, None

    def detach(self) -> Tensor:
        return self._call("detach")

    @property
    def data(self) -> Tensor:
        """The same values, outside autograd (GT's `tensor.data.numpy()`)."""
        return self.detach()

    @data.setter
    def data(self, value: Tensor) -> None:
        self._session.issue("set_data", [], [self._handle, value._handle], [0, 1], tensors=(self, value))

    # ---- operators --------------------------------------------------------------------------

    def _call(self, name, *args, **kwargs):
        (result,) = self._session.call(name, [self, *args], kwargs)
        return result

    def _rcall(self, name, other):
        (result,) = self._session.call(name, [other, self], {})
        return result

    def _inplace(self, name, *args, **kwargs) -> Tensor:
        if self._requires_grad and self.is_leaf:
            # GT's rule, not PyTorch's: updating a leaf that requires grad (GT's manual SGD,
            # `p -= lr * p.grad`) is an update of its values, outside autograd.
            with no_grad():
                self._session.call(name, [self, *args], kwargs)
            return self
        self._session.call(name, [self, *args], kwargs)
        return self

    def __add__(self, other): return self._call("add", other)
    def __radd__(self, other): return self._rcall("add", other)
    def __sub__(self, other): return self._call("sub", other)
    def __rsub__(self, other): return self._rcall("sub", other)
    def __mul__(self, other): return self._call("mul", other)
    def __rmul__(self, other): return self._rcall("mul", other)
    def __truediv__(self, other): return self._call("truediv", other)
    def __rtruediv__(self, other): return self._rcall("truediv", other)
    def __floordiv__(self, other): return self._call("floordiv", other)
    def __mod__(self, other): return self._call("mod", other)
    def __pow__(self, other): return self._call("pow", other)
    def __rpow__(self, other): return self._rcall("pow", other)
    def __matmul__(self, other): return self._call("matmul", other)
    def __rmatmul__(self, other): return self._rcall("matmul", other)
    def __neg__(self): return self._call("neg")
    def __abs__(self): return self._call("abs")
    def __lt__(self, other): return self._call("lt", other)
    def __le__(self, other): return self._call("le", other)
    def __gt__(self, other): return self._call("gt", other)
    def __ge__(self, other): return self._call("ge", other)
    def __eq__(self, other): return self._call("eq", other)
    def __ne__(self, other): return self._call("ne", other)
    def __iadd__(self, other): return self._augmented("add", other)
    def __isub__(self, other): return self._augmented("sub", other)
    def __imul__(self, other): return self._augmented("mul", other)
    def __itruediv__(self, other): return self._augmented("truediv", other)

    def _augmented(self, name, other) -> Tensor:
        """`a -= b` as GT runs it: `a` takes the result's values and its id (GT's ids change on
        every update). A leaf that requires grad (a parameter: `p -= lr * p.grad`) is updated in
        place instead, keeping its id, its gradient and its place in the optimizer."""
        inplace = _INPLACE_OF[name]
        if self._requires_grad and self.is_leaf:
            return self._inplace(inplace, other)
        result = self._call(name, other)
        if result.shape != self.shape or result.dtype != self.dtype:
            return self._inplace(inplace, other)  # PyTorch's in-place rules say what happens
        for slot in _STATE:  # `self` becomes the result; `result` keeps what `self` was
            mine, theirs = getattr(self, slot), getattr(result, slot)
            setattr(self, slot, theirs)
            setattr(result, slot, mine)
        for tensor in (self, result):
            if tensor._node is not None:
                tensor._node.tensor = weakref.ref(tensor)
        return self

    def _graph_node(self) -> Node:
        if self._node is None:
            self._node = Node(self)
        return self._node

    def __getitem__(self, index):
        return self._call("getitem", *encode_index(index))

    def __setitem__(self, index, value):
        self._inplace("setitem", value, *encode_index(index))

    # ---- methods ------------------------------------------------------------------------------

    def matmul(self, other): return self._call("matmul", other)
    def add(self, other): return self._call("add", other)
    def sub(self, other): return self._call("sub", other)
    def mul(self, other): return self._call("mul", other)
    def div(self, other): return self._call("truediv", other)
    def pow(self, exponent): return self._call("pow", exponent)
    def relu(self): return self._call("relu")
    def sigmoid(self): return self._call("sigmoid")
    def tanh(self): return self._call("tanh")
    def exp(self): return self._call("exp")
    def log(self): return self._call("log")
    def sqrt(self): return self._call("sqrt")
    def rsqrt(self): return self._call("rsqrt")
    def abs(self): return self._call("abs")
    def neg(self): return self._call("neg")
    def sin(self): return self._call("sin")
    def cos(self): return self._call("cos")
    def gelu(self, approximate: str = "none"): return self._call("gelu", approximate=approximate)
    def silu(self): return self._call("silu")
    def clamp(self, min=None, max=None): return self._call("clamp", min=min, max=max)
    def tril(self, diagonal: int = 0): return self._call("tril", diagonal=diagonal)
    def triu(self, diagonal: int = 0): return self._call("triu", diagonal=diagonal)
    def masked_fill(self, mask, value): return self._call("masked_fill", mask, value)
    def where(self, condition, other): return self._session.call("where", [condition, self, other])[0]

    def softmax(self, dim: int = -1, axis: int | None = None):
        return self._call("softmax", dim_or_axis(dim, axis))

    def log_softmax(self, dim: int = -1, axis: int | None = None):
        return self._call("log_softmax", dim_or_axis(dim, axis))

    def sum(self, dim=None, keepdim: bool = False, *, axis=None, keepdims=None):
        return self._call("sum", dim=dim_or_axis(dim, axis), keepdim=keep_dims(keepdim, keepdims))

    def mean(self, dim=None, keepdim: bool = False, *, axis=None, keepdims=None):
        return self._call("mean", dim=dim_or_axis(dim, axis), keepdim=keep_dims(keepdim, keepdims))

    def var(self, dim=None, keepdim: bool = False, *, correction: int = 1, axis=None, keepdims=None):
        return self._call("var", dim=dim_or_axis(dim, axis), keepdim=keep_dims(keepdim, keepdims), correction=correction)

    def std(self, dim=None, keepdim: bool = False, *, correction: int = 1, axis=None, keepdims=None):
        return self.var(dim, keepdim, correction=correction, axis=axis, keepdims=keepdims).sqrt()

    def max(self, dim=None, keepdim: bool = False, *, axis=None, keepdims=None):
        """No argument: the largest element. `axis=` (GT, numpy): the largest values along it.
        `dim=` (PyTorch): (values, indices)."""
        return self._extreme("max", dim, keepdim, axis, keepdims)

    def min(self, dim=None, keepdim: bool = False, *, axis=None, keepdims=None):
        return self._extreme("min", dim, keepdim, axis, keepdims)

    def _extreme(self, name, dim, keepdim, axis, keepdims):
        keep = keep_dims(keepdim, keepdims)
        if dim is None and axis is None:
            return self._call(f"{name}_all")
        if axis is not None:
            return self._call(f"a{name}", dim=axis, keepdim=keep)
        return tuple(self._session.call(name, [self, dim], {"keepdim": keep}))

    def argmax(self, dim=None, keepdim: bool = False):
        return self._call("argmax", dim=dim, keepdim=keepdim)

    def reshape(self, *shape):
        return self._call("reshape", *shape_args(shape))

    view = reshape

    def transpose(self, dim0: int | None = None, dim1: int | None = None):
        """PyTorch's transpose(dim0, dim1); without arguments GT's: swap the last two axes (a
        tensor of fewer than two axes is returned unchanged)."""
        if dim0 is None and dim1 is None:
            return self.T
        return self._call("transpose", -2 if dim0 is None else dim0, -1 if dim1 is None else dim1)

    @property
    def T(self):  # noqa: N802
        """GT's `.T`: the last two axes swapped (PyTorch's reverses them all; `permute` does that).
        A tensor of fewer than two axes is returned as it is, as in GT."""
        return self if self.ndim < 2 else self._call("transpose", -2, -1)

    @property
    def mT(self):  # noqa: N802
        return self._call("transpose", -2, -1)

    def permute(self, *dims): return self._call("permute", *shape_args(dims))
    def unsqueeze(self, dim: int): return self._call("unsqueeze", dim)
    def squeeze(self, dim: int | None = None): return self._call("squeeze", dim=dim)
    def flatten(self, start_dim: int = 0, end_dim: int = -1): return self._call("flatten", start_dim=start_dim, end_dim=end_dim)
    def expand(self, *shape): return self._call("expand", *shape_args(shape))
    def contiguous(self): return self._call("contiguous")
    def clone(self): return self._call("clone")

    def chunk(self, chunks: int, dim: int = 0):
        return tuple(self._session.call("chunk", [self, chunks], {"dim": dim}))

    def split(self, split_size, dim: int = 0):
        return tuple(self._session.call("split", [self, split_size], {"dim": dim}))

    def to(self, dtype=None, *args, **kwargs):
        """Casts to a dtype; devices are the workers' business, so a device is ignored."""
        if isinstance(dtype, str) and dtype in DTYPES:
            return self if dtype == self.dtype else self._call("to", dtype)
        return self

    def float(self): return self.to("float32")
    def double(self): return self.to("float64")
    def half(self): return self.to("float16")
    def bfloat16(self): return self.to("bfloat16")
    def long(self): return self.to("int64")

    # in place
    def add_(self, other): return self._inplace("add_", other)
    def sub_(self, other): return self._inplace("sub_", other)
    def mul_(self, other): return self._inplace("mul_", other)
    def div_(self, other): return self._inplace("div_", other)
    def zero_(self): return self._inplace("zero_")
    def fill_(self, value): return self._inplace("fill_", value)
    def copy_(self, source): return self._inplace("copy_", source)
    def clamp_(self, min=None, max=None): return self._inplace("clamp_", min=min, max=max)
    def masked_fill_(self, mask, value): return self._inplace("masked_fill_", mask, value)


_INPLACE_OF = {"add": "add_", "sub": "sub_", "mul": "mul_", "truediv": "div_"}
_STATE = ("_handle", "_requires_grad", "_node", "_has_grad", "_grad_tensor")


def _values(value):
    """`value` with every Tensor in it (in lists, tuples, dicts) replaced by its NumPy array."""
    if isinstance(value, Tensor):
        return value.numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(_values(item) for item in value)
    if isinstance(value, dict):
        return {key: _values(item) for key, item in value.items()}
    return value

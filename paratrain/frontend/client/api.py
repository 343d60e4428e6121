"""The module-level API (`gt.randn`, `gt.connect`, ...) over the program's default session
(see `defaults.py`)."""

from __future__ import annotations

import contextlib

import numpy as np

from paratrain.frontend.client.arguments import shape_args
from paratrain.frontend.client.defaults import DEFAULTS, session
from paratrain.frontend.client.session import Session
from paratrain.frontend.client.tensor import Tensor


def connect(address: str | None = None, token: str | None = None) -> Session:
    """Connect the program to the dispatcher at HOST:PORT (default `PARATRAIN_SERVER`)."""
    return DEFAULTS.connect(address, token)


def start(workers: int = 1, token: str | None = None) -> Session:
    """Start a dispatcher and `workers` workers on this machine and connect to them."""
    return DEFAULTS.start(workers, token)


def disconnect() -> None:
    """Leave the dispatcher (and stop the one this program started). What was queued since the
    last sync runs first; its errors raise here."""
    DEFAULTS.close()


def connected() -> bool:
    """Whether this program has a session (its first operation, or connect(), made one)."""
    return DEFAULTS.session is not None and not DEFAULTS.session.closed


def gpu_workers(n: int) -> None:
    """How many workers the auto-start gives this program (before its first operation)."""
    if DEFAULTS.session is not None:
        raise RuntimeError("gpu_workers() must be called before the first tensor operation")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"gpu_workers needs a positive number of workers, got {n!r}")
    DEFAULTS.workers = n


@contextlib.contextmanager
def worker(index: int):
    """Create the tensors made inside this block on worker `index` (default: the client's
    home worker). Operations run where their first tensor input lives."""
    current = session()
    if not 0 <= index < current.n_workers:
        raise ValueError(f"worker {index} does not exist (the dispatcher has {current.n_workers})")
    previous, current.placement = current.placement, index
    try:
        yield
    finally:
        current.placement = previous


# ---- making tensors ------------------------------------------------------------------------------

def _create(name: str, shape, dtype: str | None, requires_grad: bool, **kwargs) -> Tensor:
    (result,) = session().call(name, shape_args(shape), {"dtype": dtype, **kwargs}, requires_grad=requires_grad)
    return result


def randn(*shape, dtype: str = "float32", requires_grad: bool = False) -> Tensor:
    return _create("randn", shape, dtype, requires_grad)


def rand(*shape, dtype: str = "float32", requires_grad: bool = False) -> Tensor:
    return _create("rand", shape, dtype, requires_grad)


def zeros(*shape, dtype: str = "float32", requires_grad: bool = False) -> Tensor:
    return _create("zeros", shape, dtype, requires_grad)


def ones(*shape, dtype: str = "float32", requires_grad: bool = False) -> Tensor:
    return _create("ones", shape, dtype, requires_grad)


def full(shape, fill_value, dtype: str = "float32", requires_grad: bool = False) -> Tensor:
    return _create("full", (shape,), dtype, requires_grad, value=fill_value)


def uniform(shape, low: float, high: float, dtype: str = "float32", requires_grad: bool = False) -> Tensor:
    return _create("uniform", (shape,), dtype, requires_grad, low=low, high=high)


def randint(low: int, high: int, size, dtype: str = "int64") -> Tensor:
    return _create("randint", (size,), dtype, False, low=low, high=high)


def arange(start, end=None, step=1, dtype: str | None = None) -> Tensor:
    if end is None:
        start, end = 0, start
    return session().call("arange", [start, end, step], {"dtype": dtype})[0]


def from_numpy(array: np.ndarray, requires_grad: bool = False) -> Tensor:
    return session().upload(np.asarray(array), requires_grad=requires_grad)


def tensor(data, dtype: str | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor from a list or an array. GT's rule: Python data becomes float32 unless `dtype`
    says otherwise (`gt.tensor([1, 2])` is float32, where PyTorch would make int64); an array
    keeps its dtype unless `dtype` is given."""
    if isinstance(data, Tensor):
        return data.clone()
    if isinstance(data, np.ndarray):
        array = data if dtype is None else data.astype(dtype)
    else:
        array = np.asarray(data, dtype=dtype or "float32")
    return from_numpy(array, requires_grad)


def zeros_like(x: Tensor) -> Tensor:
    return x._session.call("zeros_like", [x])[0]


def ones_like(x: Tensor) -> Tensor:
    return x._session.call("ones_like", [x])[0]


def randn_like(x: Tensor) -> Tensor:
    return x._session.call("randn_like", [x])[0]


def manual_seed(seed: int) -> None:
    """Seed every worker's random number generator."""
    session().issue("manual_seed", [], [int(seed)], [])


# ---- functions over tensors -------------------------------------------------------------------

def cat(tensors, dim: int = 0, axis: int | None = None) -> Tensor:
    tensors = list(tensors)
    return tensors[0]._session.call("cat", tensors, {"dim": axis if axis is not None else dim})[0]


def stack(tensors, dim: int = 0) -> Tensor:
    tensors = list(tensors)
    return tensors[0]._session.call("stack", tensors, {"dim": dim})[0]


def where(condition: Tensor, a, b) -> Tensor:
    return condition._session.call("where", [condition, a, b])[0]


def matmul(a: Tensor, b: Tensor) -> Tensor:
    return a @ b


def maximum(a: Tensor, b: Tensor) -> Tensor:
    return a._session.call("maximum", [a, b])[0]


def minimum(a: Tensor, b: Tensor) -> Tensor:
    return a._session.call("minimum", [a, b])[0]

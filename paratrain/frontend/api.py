"""The module-level API (`gt.randn`, `gt.connect`, ...) over a default session.

GT's programs never name a connection, so the frontend keeps one default session per
program: `connect(address)` sets it, and otherwise the first operation makes it, connecting to
`PARATRAIN_SERVER` if that is set, or else starting a dispatcher and `gpu_workers(n)` workers
on this machine (one by default), which stop when the program exits. Everything else takes its
session from the tensors it is given, so several explicit `Session`s can live side by side.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading

import numpy as np

from paratrain.frontend.client.session import Session
from paratrain.frontend.client.tensor import Tensor
from paratrain.frontend.client.tensor import from_numpy as _from_numpy


class _Defaults:
    """The default session and the server it may have started (one per program)."""

    def __init__(self):
        self.session: Session | None = None
        self.server = None
        self.workers = 1

    def get(self) -> Session:
        if self.session is None or self.session.closed:
            address = os.environ.get("PARATRAIN_SERVER")
            if address:
                connect(address)
            else:
                start(self.workers)
        return self.session

    def connected(self, session: Session) -> Session:
        """A new default session: it takes the signal configuration GT_CONFIG / PARATRAIN_CONFIG
        names, if one does."""
        from paratrain.frontend.client.signal import load_config

        self.session = session
        path = os.environ.get("PARATRAIN_CONFIG") or os.environ.get("GT_CONFIG")
        if path:
            load_config(path, session)
        return session

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
        if self.server is not None:
            self.server.stop()
            self.server = None


_defaults = _Defaults()
atexit.register(_defaults.close)


def connect(address: str | None = None, token: str | None = None) -> Session:
    """Connect the program to the dispatcher at HOST:PORT (default `PARATRAIN_SERVER`)."""
    address = address or os.environ.get("PARATRAIN_SERVER")
    if not address:
        raise ValueError("connect() needs an address HOST:PORT (or PARATRAIN_SERVER)")
    if _defaults.session is not None and not _defaults.session.closed:
        raise RuntimeError(f"already connected to {_defaults.session.address}; call disconnect() first")
    return _defaults.connected(Session(address, token=token or os.environ.get("PARATRAIN_TOKEN")))


def start(workers: int = 1, token: str | None = None) -> Session:
    """Start a dispatcher and `workers` workers on this machine and connect to them."""
    from paratrain.frontend.client.shapes import warm_up
    from paratrain.frontend.server import LocalServer

    if _defaults.session is not None and not _defaults.session.closed:
        raise RuntimeError(f"already connected to {_defaults.session.address}; call disconnect() first")
    warming = threading.Thread(target=warm_up, name="frontend-warm-up", daemon=True)
    warming.start()
    _defaults.server = LocalServer.start(workers, token=token)
    warming.join()
    session = Session(_defaults.server.address, token=token)
    process = _defaults.server.process
    session.server_alive = lambda: process.poll() is None
    return _defaults.connected(session)


def disconnect() -> None:
    """Leave the dispatcher (and stop the one this program started)."""
    _defaults.close()


def gpu_workers(n: int) -> None:
    """How many workers the auto-start gives this program (before its first operation)."""
    if _defaults.session is not None:
        raise RuntimeError("gpu_workers() must be called before the first tensor operation")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"gpu_workers needs a positive number of workers, got {n!r}")
    _defaults.workers = n


def session() -> Session:
    """The program's default session (connecting or starting one on first use)."""
    return _defaults.get()


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
    current = session()
    flags = {}
    if requires_grad:
        flags["rg"] = 1
    if current.placement is not None:
        flags["w"] = current.placement
    args = list(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else list(shape)
    (result,) = current.call(name, [int(s) for s in args], {"dtype": dtype, **kwargs}, flags=flags or None)
    if requires_grad:
        result._requires_grad = True
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
    current = session()
    flags = {"w": current.placement} if current.placement is not None else None
    return current.call("arange", [start, end, step], {"dtype": dtype}, flags=flags)[0]


def from_numpy(array: np.ndarray, requires_grad: bool = False) -> Tensor:
    return _from_numpy(np.asarray(array), requires_grad, session=session())


def tensor(data, dtype: str | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor from a list or array; dtypes follow PyTorch (Python floats -> float32)."""
    if isinstance(data, Tensor):
        return data.clone()
    array = np.asarray(data, dtype=dtype)
    if dtype is None and array.dtype == np.float64:
        array = array.astype(np.float32)
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

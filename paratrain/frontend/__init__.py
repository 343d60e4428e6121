"""paratrain's single-controller frontend, GT's API on paratrain's workers.

    import paratrain.frontend as gt

    w = gt.randn(128, 64, requires_grad=True)      # lives on a worker; returns at once
    loss = (gt.randn(32, 128) @ w).relu().mean()
    loss.backward()                                 # one instruction: autograd runs on the worker
    print(loss.item(), w.grad.shape)                # item() is where the client waits

Three kinds of process, a folder each: `client/` (this API: tensors, sessions, nn, optim),
`dispatcher/` (`paratrain serve`: peers, routing, syncs) and `workers/` (`paratrain worker`:
running instructions on tensors). They share only `protocol/` (every message a typed class),
`ops.py` (the table of operations), `shapes.py` (shape inference) and `signals.py` (signal
configurations). The workers form one paratrain world and move tensors with its point-to-point.
"""

from paratrain.frontend.client import debug, functional, nn, optim, pipeline, signal
from paratrain.frontend.client.api import (
    arange, cat, connect, connected, disconnect, from_numpy, full, gpu_workers, manual_seed, matmul, maximum,
    minimum, ones, ones_like, rand, randint, randn, randn_like, stack, start, tensor, uniform, where,
    worker, zeros, zeros_like,
)
from paratrain.frontend.client.autograd import enable_grad, is_grad_enabled, no_grad
from paratrain.frontend.client.defaults import session
from paratrain.frontend.client.functional import (
    cross_entropy, gelu, layer_norm, log_softmax, relu, sigmoid, softmax, tanh,
)
from paratrain.frontend.client.session import Session
from paratrain.frontend.client.config import ShardConfig, SignalConfig
from paratrain.frontend.client.signal import get_config, get_signal_config, load_config, register_config
from paratrain.frontend.client.tensor import Tensor
from paratrain.frontend.errors import (
    AuthenticationError, ConnectionLost, DispatcherUnreachable, FrontendError, ProtocolError, RemoteError,
    WorkerLost,
)
from paratrain.frontend.shapes import ShapeError
from paratrain.frontend.signals import ConfigError

float32, float64, float16, bfloat16 = "float32", "float64", "float16", "bfloat16"
int64, int32, int16, int8, uint8 = "int64", "int32", "int16", "int8", "uint8"
bool_ = "bool"
long, half, float, double = "int64", "float16", "float32", "float64"
bool = "bool"  # noqa: A001 - GT's name for the dtype

__all__ = [name for name in dir() if not name.startswith("_")]

"""`gt.nn`: modules written against the frontend's tensors.

`Linear` keeps GT's layout: its weight is [in_features, out_features] and it computes
`x @ weight + bias` (PyTorch's is [out, in] with `x @ weight.T`); this is the layout the seed's
sharding configuration splits (column-parallel: axis 1, row-parallel: axis 0). Weights are
initialised on the workers with PyTorch's default distributions, so nothing is uploaded.
"""

from __future__ import annotations

import math

import numpy as np

from paratrain.frontend.client import api, functional
from paratrain.frontend.client.autograd import no_grad
from paratrain.frontend.client.functional import (  # noqa: F401 - GT exposes these on nn
    binary_cross_entropy, cross_entropy, cross_entropy_loss, dropout, embedding, gelu, layer_norm, linear, log_softmax,
    mse_loss, relu, scaled_dot_product_attention, sigmoid, silu, softmax, tanh,
)
from paratrain.frontend.client.optim import SGD, AdamW  # noqa: F401 - GT's `from gt.nn import SGD`
from paratrain.frontend.client.tensor import Tensor


def Parameter(tensor: Tensor, requires_grad: bool = True) -> Tensor:  # noqa: N802 - PyTorch's name
    """Make `tensor` a leaf that (by default) requires grad, as `torch.nn.Parameter` does."""
    if not tensor.is_leaf:
        tensor = tensor.detach()
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


class Module:
    def __init__(self):
        object.__setattr__(self, "_parameters", [])
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if "_modules" not in self.__dict__:
            Module.__init__(self)
        if isinstance(value, Module):
            self._modules[name] = value
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, Module) for v in value):
            for i, module in enumerate(value):
                self._modules[f"{name}.{i}"] = module
        elif isinstance(value, Tensor) and value.is_leaf and value.requires_grad:
            self._parameters.append(value)
        object.__setattr__(self, name, value)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def named_parameters(self, prefix: str = ""):
        seen = set()
        own = {id(v): k for k, v in self.__dict__.items() if isinstance(v, Tensor)}
        for i, param in enumerate(self._parameters):
            if id(param) not in seen:
                seen.add(id(param))
                yield prefix + own.get(id(param), f"param{i}"), param
        for name, module in self._modules.items():
            for sub, param in module.named_parameters(f"{prefix}{name}."):
                if id(param) not in seen:
                    seen.add(id(param))
                    yield sub, param

    def parameters(self) -> list[Tensor]:
        return [param for _, param in self.named_parameters()]

    def modules(self):
        yield self
        for module in self._modules.values():
            yield from module.modules()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.parameters():
            if param._has_grad:  # (reading .grad would issue an instruction)
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    def train(self, mode: bool = True):
        for module in self.modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every parameter's values, fetched in one sync."""
        named = list(self.named_parameters())
        if not named:
            return {}
        values = named[0][1]._session.sync([param._handle for _, param in named])
        return {name: value for (name, _), value in zip(named, values)}

    def load_state_dict(self, state: dict) -> None:
        params = dict(self.named_parameters())
        missing = set(params) - set(state)
        if missing:
            raise KeyError(f"load_state_dict: missing {sorted(missing)}")
        with no_grad():
            for name, param in params.items():
                value = np.asarray(state[name])
                if tuple(value.shape) != param.shape:
                    raise ValueError(f"load_state_dict: {name} has shape {list(param.shape)}, got {list(value.shape)}")
                param.copy_(api.from_numpy(value.astype(np.dtype(param.dtype if param.dtype != "bfloat16" else "float32"))))


class Linear(Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: str = "float32"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        bound = 1 / math.sqrt(in_features)  # PyTorch's default (kaiming uniform, a=sqrt(5))
        self.weight = Parameter(api.uniform((in_features, out_features), -bound, bound, dtype=dtype))
        self.bias = Parameter(api.uniform((out_features,), -bound, bound, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return functional.linear(x, self.weight, self.bias)


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: str = "float32"):
        super().__init__()
        self.weight = Parameter(api.randn(num_embeddings, embedding_dim, dtype=dtype))

    def forward(self, indices: Tensor) -> Tensor:
        return embedding(indices, self.weight)


class LayerNorm(Module):
    def __init__(self, normalized_shape: int, eps: float = 1e-5, dtype: str = "float32"):
        super().__init__()
        self.normalized_shape, self.eps = normalized_shape, eps
        self.weight = Parameter(api.ones(normalized_shape, dtype=dtype))
        self.bias = Parameter(api.zeros(normalized_shape, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class Sequential(Module):
    def __init__(self, *modules: Module):
        super().__init__()
        self.layers = list(modules)

    def forward(self, x):
        for module in self.layers:
            x = module(x)
        return x


class ReLU(Module):
    def forward(self, x): return x.relu()


class GELU(Module):
    def forward(self, x): return x.gelu()


class Sigmoid(Module):
    def forward(self, x): return x.sigmoid()


class Tanh(Module):
    def forward(self, x): return x.tanh()


class Dropout(Module):
    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = p

    def forward(self, x):
        return dropout(x, self.p, self.training)

"""Functions of `gt.nn.functional` (and GT's `gt.nn`): PyTorch's names and arguments."""

from __future__ import annotations


def _call(name, args, **kwargs):
    session = next(arg for arg in args if hasattr(arg, "_session"))._session
    return session.call(name, list(args), kwargs)[0]


def relu(x): return x.relu()
def sigmoid(x): return x.sigmoid()
def tanh(x): return x.tanh()
def silu(x): return x.silu()
def gelu(x, approximate: str = "none"): return x.gelu(approximate)
def softmax(x, dim: int = -1): return x.softmax(dim)
def log_softmax(x, dim: int = -1): return x.log_softmax(dim)


def cross_entropy(logits, target, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0):
    return _call("cross_entropy", [logits, target], ignore_index=ignore_index, reduction=reduction,
                 label_smoothing=label_smoothing)


def mse_loss(predicted, target, reduction: str = "mean"):
    return _call("mse_loss", [predicted, target], reduction=reduction)


def binary_cross_entropy(predicted, target, eps: float = 1e-7):
    """GT's formula: -mean(t log(p + eps) + (1 - t) log(1 - p + eps))."""
    return -(target * (predicted + eps).log() + (1 - target) * (1 - predicted + eps).log()).mean()


def cross_entropy_loss(logits, targets):
    """GT's cross_entropy_loss: binary cross-entropy of sigmoid(logits) against 0/1 targets
    (for classes over the last axis, use `cross_entropy`, PyTorch's)."""
    return binary_cross_entropy(logits.sigmoid(), targets)


def linear(x, weight, bias=None):
    """x @ weight + bias, with `weight` stored [in_features, out_features] (GT's layout)."""
    return _call("linear", [x, weight, bias])


def embedding(indices, weight):
    return _call("embedding", [indices, weight])


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    return _call("layer_norm", [x, weight, bias, shape], eps=eps)


def dropout(x, p: float = 0.5, training: bool = True):
    return _call("dropout", [x], p=p, training=training) if training and p > 0 else x


def scaled_dot_product_attention(query, key, value, is_causal: bool = False, scale: float | None = None):
    return _call("sdpa", [query, key, value], is_causal=is_causal, scale=scale)

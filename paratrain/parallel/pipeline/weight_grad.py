"""The zero-bubble split of a chunk's backward: B now, the linear layers' weight gradients later.

A linear layer's backward is two matrix products: dX = dY @ W (the previous stage waits for
it) and dW = dY^T @ X (nobody waits for it). B runs autograd down to the chunk's input, asking
only for dX, the gradients of the cheap parameters (norms, embeddings) and dY at every
linear layer's output; W later does just the dW products from the X and dY kept for it. So
B + W cost one ordinary backward, and the W work can fill the schedule's bubbles.

Linear layers are found by type (nn.Linear and the tensor-parallel linears without sequence
parallelism, whose dW is the same product); `supports(chunk)` says whether a chunk can be
split this way (activation checkpointing re-runs forwards inside backward, which this does
not follow, so it falls back to letting autograd re-traverse the graph for W).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from paratrain.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


def _is_linear(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not module.sequence_parallel


def supports(chunk: nn.Module) -> bool:
    """True unless a tensor-parallel linear shards the sequence (its dY is not the product's)."""
    return not any(
        isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.sequence_parallel for m in chunk.modules()
    )


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Add into .grad in place: under data parallelism .grad is a view of a bucket."""
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad.clone()
    else:
        param.grad.add_(grad)


class SplitBackward:
    """One chunk's B and W passes. F records each linear layer's input and output."""

    def __init__(self, chunk: nn.Module):
        self.linears = [m for m in chunk.modules() if _is_linear(m)]
        in_linears = {id(p) for m in self.linears for p in m.parameters(recurse=False)}
        self.other_params = [p for p in chunk.parameters() if p.requires_grad and id(p) not in in_linears]
        self._records: list | None = None
        for module in self.linears:
            module.register_forward_hook(self._record)

    def _record(self, module, inputs, output) -> None:
        if self._records is not None:
            self._records.append((module, inputs[0], output))

    @contextmanager
    def recording(self):
        """Run a forward inside; yields the list its linear layers' (module, X, Y) land in."""
        self._records = records = []
        try:
            yield records
        finally:
            self._records = None

    def backward_input(self, out, grad, x, records) -> list:
        """B: x.grad (if x needs one) and the cheap parameters' gradients; returns what W needs."""
        wants_x = x is not None and x.requires_grad
        targets = ([x] if wants_x else []) + self.other_params + [y for _, _, y in records]
        grads = torch.autograd.grad(out, targets, grad, allow_unused=True)
        if wants_x:
            x.grad = grads[0]
        offset = int(wants_x)
        for param, g in zip(self.other_params, grads[offset:]):
            if g is not None:
                _accumulate(param, g)
        offset += len(self.other_params)
        return [(module, x_in.detach(), dy) for (module, x_in, _), dy in zip(records, grads[offset:]) if dy is not None]

    def backward_weight(self, stash: list, grad_ready=None) -> None:
        """W: dW = dY^T X and db = sum dY for each linear layer the microbatch went through.

        These gradients are written by hand, so autograd's post-accumulate hooks (which data
        parallelism listens to, to start a bucket's all-reduce) never fire: `grad_ready(param)`
        is called instead as each is written, and for the cheap parameters B wrote before."""
        for module, x_in, dy in stash:
            dy_2d = dy.reshape(-1, dy.shape[-1]).to(module.weight.dtype)
            x_2d = x_in.reshape(-1, x_in.shape[-1]).to(module.weight.dtype)
            _accumulate(module.weight, dy_2d.t() @ x_2d)
            if module.bias is not None:
                _accumulate(module.bias, dy_2d.sum(0))
            if grad_ready is not None:
                for param in (module.weight, module.bias):
                    if param is not None:
                        grad_ready(param)
        if grad_ready is not None:
            for param in self.other_params:
                if param.grad is not None:
                    grad_ready(param)

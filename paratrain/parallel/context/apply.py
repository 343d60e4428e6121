"""Context parallelism applied to a model from outside it, as its plan says (plan.py's
`context_parallel`): the attention modules' `F.scaled_dot_product_attention` calls become
`context_attention` over the context group, and the position buffers are cut like the tokens.

The capture is the way PyTorch's own `context_parallel` does it: a TorchFunctionMode that stands
in for `scaled_dot_product_attention`, here entered only around the plan's attention modules (a
pre-hook enters it, a hook that runs even on an error leaves it), so nothing else the model calls
is touched, and every layout (tensor, pipeline, data parallel) that calls the modules gets it.

Positions: a model reads its tokens' positions from a buffer indexed by position, as
`positions[:T]` (our GPT's and Llama's `positions`, an arange; a rotary table would do too).
Rank r's buffer becomes the rows of its own tokens, in the order it holds them (layout.py), so
`[:T]` of the local length gives each token its global position. Apply it before the pipeline
cuts the model: the stages read the same buffers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from paratrain.parallel.context.attention import context_attention
from paratrain.parallel.context.layout import positions as positions_of
from paratrain.parallel.plan import Plan, PlanError, matches, matching_modules


class ContextError(ValueError):
    """An attention call context parallelism cannot take (one line)."""


class _ContextAttention(TorchFunctionMode):
    """Inside an attention module: its scaled_dot_product_attention runs over the context group."""

    def __init__(self, group, layout: str, method: str, where: str):
        super().__init__()
        self.group, self.layout, self.method, self.where = group, layout, method, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        if attn_mask is not None:
            raise ContextError(f"{self.where}: context parallelism takes is_causal or no mask, not an attn_mask")
        if dropout_p:
            raise ContextError(f"{self.where}: attention dropout ({dropout_p}) is not supported under context "
                               "parallelism; set the model's dropout to 0")
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise ContextError(f"{self.where}: {query.shape[1]} query heads against {key.shape[1]} key heads "
                               "without enable_gqa")
        return context_attention(query, key, value, self.group, causal=is_causal, layout=self.layout,
                                 method=self.method, scale=scale)


def apply_context_parallel(model: nn.Module, plan: Plan, group, seq_len: int, layout: str = "zigzag",
                           method: str = "ring") -> list:
    """Make `model` run on this rank's part of sequences of `seq_len` tokens; -> the hooks'
    handles (remove them to undo the attention capture)."""
    if plan.context is None:
        raise PlanError(f"{plan.source}: no context_parallel section: name the attention modules "
                        "(and the position buffers) for --cp")
    handles = []
    for pattern in plan.context.attention:
        found = matching_modules(model, pattern)
        if not found:
            raise PlanError(f"{plan.source}: context_parallel.attention pattern {pattern!r} matches no module")
        for name, module in found:
            mode = _ContextAttention(group, layout, method, name)
            handles.append(module.register_forward_pre_hook(lambda *_, mode=mode: _enter(mode)))
            handles.append(module.register_forward_hook(lambda *_, mode=mode: _leave(mode), always_call=True))
    for owner, name, buffer in position_buffers(model, plan):
        if buffer.shape[0] < seq_len:
            raise PlanError(f"{plan.source}: position buffer {name} has {buffer.shape[0]} rows, "
                            f"fewer than the sequence's {seq_len}")
        mine = positions_of(group.rank, group.size, seq_len, layout, device=buffer.device)
        setattr(owner, name.rsplit(".", 1)[-1], buffer[mine])  # stays the same registered buffer
    return handles


def _enter(mode: TorchFunctionMode) -> None:  # (a pre-hook's return value would replace the inputs)
    mode.__enter__()


def _leave(mode: TorchFunctionMode) -> None:
    mode.__exit__(None, None, None)


def position_buffers(model: nn.Module, plan: Plan) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(owning module, path, buffer) for every buffer the plan's positions name."""
    found = []
    for pattern in plan.context.positions:
        matched = [(path, buffer) for path, buffer in model.named_buffers() if matches(pattern, path)]
        if not matched:
            raise PlanError(f"{plan.source}: context_parallel.positions pattern {pattern!r} matches no buffer")
        for path, buffer in matched:
            owner = model.get_submodule(path.rpartition(".")[0])
            found.append((owner, path, buffer))
    return found

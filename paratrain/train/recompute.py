"""Activation checkpointing (`--checkpoint-activations`), for every layout.

Each layer's forward is replaced, on the instance, by one that runs it under
`torch.utils.checkpoint`: only the layer's input is kept, and its activations are recomputed
inside backward. Replacing the instance's `forward` keeps the module tree and the parameter
names unchanged (checkpoints, `full_state` and DDP see the same model), and the pipeline's
chunks, which call the same block objects, are checkpointed too.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.models.plans import default_plan
from paratrain.parallel.plan import block_list, load_plan


def layers_to_recompute(model: nn.Module, plan=None) -> list[nn.Module]:
    """The repeated layers whose activations dominate: the model's blocks (the block list its
    plan names, or its structure shows: a CNN's conv blocks, an MLP stack's layers), or else each
    of its children that holds parameters (the two-layer MLP's linears)."""
    plan = plan if plan is not None else default_plan(model)
    blocks = block_list(model, None if plan is None else load_plan(plan))
    if blocks is not None:
        return list(blocks)
    children = [child for child in model.children() if any(True for _ in child.parameters())]
    if not children:
        raise ValueError(f"activation checkpointing finds no layers in {type(model).__name__}")
    return children


def recompute_in_backward(model: nn.Module, plan=None) -> int:
    """Checkpoint each layer of `model` in place; returns how many layers."""
    layers = layers_to_recompute(model, plan)
    for layer in layers:
        layer.forward = _checkpointed(layer.forward)
    return len(layers)


def _checkpointed(forward):
    def forward_keeping_only_the_input(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return forward_keeping_only_the_input

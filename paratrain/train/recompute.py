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

from paratrain.models import CNN, MLP, DeepMLP
from paratrain.models.plans import default_plan
from paratrain.parallel.plan import load_plan


def layers_to_recompute(model: nn.Module, plan=None) -> list[nn.Module]:
    """The repeated layers whose activations dominate: a language model's blocks (the block
    list its plan names: the GPT's, Llama's, a user's), a CNN's conv blocks, the MLPs' linear layers."""
    plan = plan if plan is not None else default_plan(model)
    if plan is not None and load_plan(plan).pipeline is not None:
        return list(model.get_submodule(load_plan(plan).pipeline.blocks))
    if isinstance(model, CNN):
        return list(model.blocks)
    if isinstance(model, DeepMLP):
        return list(model.layers)
    if isinstance(model, MLP):
        return [model.fc1, model.fc2]
    raise ValueError(f"activation checkpointing does not know the layers of {type(model).__name__}")


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

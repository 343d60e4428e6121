"""--compile: each layer of the model through torch.compile, measured beside eager.

The layers are those activation checkpointing takes (recompute.layers_to_recompute: the plan's
blocks, a CNN's conv blocks, an MLP stack's layers). Each layer's `forward` is replaced on the
instance, as recompute does, so the module tree, the parameter names and checkpoints stay as
they are, and module hooks (FSDP's gathers around a unit) stay outside the compiled code. A
collective inside a tensor-parallel layer's forward breaks its graph there: dynamo runs it
eagerly between two compiled pieces.

The training loop runs the first steps eager and switches to the compiled layers after, so the
summary gives both in one run: the eager step (the second; the first warms up), the first
compiled step (which compiles), and the compiled steps after it.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.train.recompute import layers_to_recompute

EAGER_STEPS = 2  # before the switch: a warm-up step, then one timed eager step


class CompiledLayers:
    def __init__(self, model: nn.Module, plan=None, backend: str = "inductor"):
        self.layers = layers_to_recompute(model, plan)
        self.eager = [layer.forward for layer in self.layers]
        self.compiled = [torch.compile(forward, backend=backend) for forward in self.eager]  # compiled at first call
        self.on = False
        self.use(True)

    def use(self, compiled: bool) -> None:
        for layer, eager, faster in zip(self.layers, self.eager, self.compiled):
            layer.forward = faster if compiled else eager
        self.on = compiled


def compile_summary(log: list[dict]) -> dict:
    """Eager and compiled step times from a log whose entries say `compiled`."""
    eager = [entry["step_ms"] for entry in log if not entry.get("compiled")]
    compiled = [entry["step_ms"] for entry in log if entry.get("compiled")]
    if len(eager) < 2 or len(compiled) < 2:
        return {}  # too few steps to tell: the summary's step time is all there is
    eager_ms, compiled_ms = sum(eager[1:]) / len(eager[1:]), sum(compiled[1:]) / len(compiled[1:])
    return {"eager_step_ms": eager_ms, "compiled_step_ms": compiled_ms, "first_compiled_step_ms": compiled[0],
            "compile_speedup": eager_ms / compiled_ms}

"""Cut a model into pipeline chunks: a list of layers, then contiguous runs of them.

The models know nothing of pipelines. A language model reads as a sequence of layers by its
plan (parallel/plan.py: what runs before the blocks, the blocks, what runs after; the GPT's and
Llama's plans are in models/plans.py); the MLPs, which have no plan, as their linears. The
layers wrap the model's own modules, so a chunk holds the very parameters of the model it
was cut from, and their names stay the model's names.

Chunks are balanced by cost (parameters of the matrix multiplies, which is what forward and
backward time follows; an embedding lookup costs next to nothing) or given explicitly.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models import MLP, DeepMLP
from paratrain.models.plans import default_plan
from paratrain.parallel import plan as plans


class Activated(nn.Module):
    """A linear layer followed by its activation, as the MLPs apply them."""

    def __init__(self, linear: nn.Linear, activation):
        super().__init__()
        self.linear, self.activation = linear, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return self.activation(y) if self.activation is not None else y


def pipeline_layers(model: nn.Module, plan=None) -> list[nn.Module]:
    """The model as an ordered list of layers whose composition is its forward: by `plan`
    (a Plan, dict or YAML path), else by the model's own plan, else (the MLPs) its linears."""
    plan = plan if plan is not None else default_plan(model)
    if plan is not None:
        return plans.pipeline_layers(model, plans.load_plan(plan))
    if isinstance(model, DeepMLP):
        last = len(model.layers) - 1
        return [Activated(layer, F.relu if i < last else None) for i, layer in enumerate(model.layers)]
    if isinstance(model, MLP):
        return [Activated(model.fc1, F.gelu), Activated(model.fc2, None)]
    raise ValueError(f"{type(model).__name__} cannot be split into pipeline stages")


def layer_costs(layers: list[nn.Module], balance: str = "cost", sample=None) -> list[int]:
    """What balanced_partition evens out: each layer's cost; or (balance "count") one per block
    and nothing for a plan's before/after layers, so chunks get equal numbers of blocks; or
    (balance "measured") each layer's forward and backward time on `sample`, an input batch.

    Measured times differ from rank to rank: a caller whose ranks must cut at the same place
    broadcasts one rank's (see train/parallel_model.py)."""
    if balance == "count":
        return [0 if isinstance(layer, plans.RunInOrder) else 1 for layer in layers]
    if balance == "measured":
        return measured_costs(layers, sample)
    return [layer_cost(layer) for layer in layers]


def measured_costs(layers: list[nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[int]:
    """Microseconds of each layer's forward and backward on what the layers before it make of
    `sample` (the best of `repeats`, at least 1). Leaves no gradients behind."""
    costs, x = [], sample
    for layer in layers:
        x = x.detach().requires_grad_(x.is_floating_point())
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            y = layer(x)
            y.float().sum().backward()
            best = min(best, time.perf_counter() - started)
        costs.append(max(int(best * 1e6), 1))
        x = y
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return costs


def layer_cost(layer: nn.Module) -> int:
    """Parameters of the layer's matrix multiplies (at least 1, so no layer is free)."""
    cost = 0
    for module in layer.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and "Embedding" not in type(module).__name__:
            cost += weight.numel()
    return max(cost, 1)


def balanced_partition(costs: list[int], parts: int) -> list[int]:
    """Layer counts of `parts` contiguous runs minimising the most expensive run.

    Exact, by dynamic programming over (layers used, runs made): fine for the tens of layers
    a pipeline splits.
    """
    n = len(costs)
    if parts > n:
        raise ValueError(f"cannot split {n} layers into {parts} chunks: fewer layers than chunks")
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    best = [[inf] * (parts + 1) for _ in range(n + 1)]  # best[i][k]: first i layers in k runs
    cut = [[0] * (parts + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[j][k - 1], prefix[i] - prefix[j])
                if value < best[i][k]:
                    best[i][k], cut[i][k] = value, j
    counts, i = [], n
    for k in range(parts, 0, -1):
        counts.append(i - cut[i][k])
        i = cut[i][k]
    return counts[::-1]


def split_layers(layers: list[nn.Module], parts: int, counts: list[int] | None = None) -> list[nn.Sequential]:
    """`parts` chunks of consecutive layers: balanced, or with the given layer counts."""
    if counts is None:
        counts = balanced_partition([layer_cost(layer) for layer in layers], parts)
    if len(counts) != parts or sum(counts) != len(layers) or min(counts) < 1:
        raise ValueError(
            f"layer counts {counts} must be {parts} positive numbers adding up to {len(layers)} layers"
        )
    chunks, start = [], 0
    for count in counts:
        chunks.append(nn.Sequential(*layers[start : start + count]))
        start += count
    return chunks

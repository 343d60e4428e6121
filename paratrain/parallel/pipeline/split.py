"""Cut a model into pipeline chunks: a list of layers, then contiguous runs of them.

The models know nothing of pipelines; this module knows how each one reads as a sequence of
layers (a GPT: embeddings, the blocks, the final norm and head; an MLP: its linears). The
layers wrap the model's own modules, so a chunk holds the very parameters of the model it
was cut from, and their names stay the model's names.

Chunks are balanced by cost (parameters of the matrix multiplies, which is what forward and
backward time follows; an embedding lookup costs next to nothing) or given explicitly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models import GPT, MLP, DeepMLP


class GPTEmbedding(nn.Module):
    """Token plus position embedding: the GPT's first layer."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.tok_emb, self.pos_emb, self.emb_drop = gpt.tok_emb, gpt.pos_emb, gpt.emb_drop

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        pos_T = torch.arange(idx_BT.shape[1], device=idx_BT.device)
        return self.emb_drop(self.tok_emb(idx_BT) + self.pos_emb(pos_T))


class GPTHead(nn.Module):
    """Final norm and the vocabulary projection: the GPT's last layer."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x_BTD))


class Activated(nn.Module):
    """A linear layer followed by its activation, as the MLPs apply them."""

    def __init__(self, linear: nn.Linear, activation):
        super().__init__()
        self.linear, self.activation = linear, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return self.activation(y) if self.activation is not None else y


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """The model as an ordered list of layers whose composition is its forward."""
    if isinstance(model, GPT):
        return [GPTEmbedding(model), *model.blocks, GPTHead(model)]
    if isinstance(model, DeepMLP):
        last = len(model.layers) - 1
        return [Activated(layer, F.relu if i < last else None) for i, layer in enumerate(model.layers)]
    if isinstance(model, MLP):
        return [Activated(model.fc1, F.gelu), Activated(model.fc2, None)]
    raise ValueError(f"{type(model).__name__} cannot be split into pipeline stages")


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

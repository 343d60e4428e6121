"""Expert parallelism applied to a model from outside it: every mixture-of-experts layer keeps
this rank's slice of its experts, and its tokens reach them through dispatch.py.

Rank r of an ep group of size ep keeps experts r·E/ep .. (r+1)·E/ep − 1 of each layer (the
stacked w1, w3, w2 cut along their first dimension), marked `expert_parallel` so that the
data-parallel strategy leaves them to parallel/expert/gradients.py. The router, the shared
experts, attention and everything else stay whole on every rank. Every rank starts from the
same whole model (built from one seed), so the slices together are the single-device experts.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from paratrain.models.moe import moe_layers
from paratrain.parallel.expert.dispatch import DispatchCounts, expert_parallel

EXPERT_WEIGHTS = ("w1", "w3", "w2")
RECORDS = 1024


class ExpertParallelDispatcher:
    """A layer's routed experts over an ep group: each token sent once per rank it needs."""

    def __init__(self, group, local_experts: int):
        self.group, self.local_experts = group, local_experts
        # What each forward sent, the latest RECORDS of them (bench moe reads and clears them each
        # step); bounded, so that a long run that never reads them holds no more than that.
        self.sent: deque[DispatchCounts] = deque(maxlen=RECORDS)

    def routed(self, x_ND: torch.Tensor, experts_NK: torch.Tensor, weights_NK: torch.Tensor, experts) -> torch.Tensor:
        """Σ_k weights · expert(x) per token; a dropped choice is expert −1."""
        out_ND, counts = expert_parallel(x_ND, experts_NK, weights_NK, self.group, self.local_experts, experts)
        self.sent.append(counts)
        return out_ND


def apply_expert_parallel(model: nn.Module, group) -> int:
    """Cut every MoE layer's experts to this rank's slice and route through `group`; returns
    the number of layers changed."""
    layers = moe_layers(model)
    for layer in layers:
        experts = layer.experts
        total = experts.local_experts
        if total % group.size:
            raise ValueError(f"expert parallelism: ep ({group.size}) must divide the experts ({total})")
        local = total // group.size
        first = group.rank * local
        for name in EXPERT_WEIGHTS:
            whole = getattr(experts, name)
            mine = nn.Parameter(whole.detach()[first:first + local].clone(), requires_grad=whole.requires_grad)
            mine.expert_parallel = True
            setattr(experts, name, mine)
        experts.first_expert, experts.local_experts = first, local
        layer.dispatcher = ExpertParallelDispatcher(group, local)
    return len(layers)

"""Token-choice top-k routing for a mixture-of-experts layer: which experts each token goes to,
with what gate weight, which (token, expert) pairs a capacity drops, and the sequence-wise
balance loss of the choice.

Every rule here is per sequence (capacity, the balance loss), so the same batch gives the same
routing and the same loss however it is split over data-parallel ranks and microbatches.

Rules a reader needs:
- Scores are softmax or sigmoid of the gate's logits, in fp32 at least (fp64 stays fp64).
- The choice is the k highest of score + expert_bias (the bias balances load without a loss; it
  never enters the gate weights). Ties go to the lower expert index: a stable descending sort,
  the same on every device, where torch.topk's order among equals is its kernel's.
- Gate weights are the chosen experts' scores, divided by their sum when `renormalize`.
- Capacity (per sequence and expert, ceil(factor * T * k / E)): an expert keeps its earliest
  tokens in position order and drops the rest; a dropped pair contributes nothing and the
  token's other gate weights are not renormalised.

Shape legend:
    B batch     T sequence position     D d_model     E experts     K experts chosen per token
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class Routing:
    experts_BTK: torch.Tensor  # chosen experts, int64, highest score first
    weights_BTK: torch.Tensor  # their gate weights (the score dtype)
    kept_BTK: torch.Tensor  # bool: False where capacity dropped the pair
    probs_BTE: torch.Tensor  # scores normalised to sum 1 over the experts: the balance loss's P

    @property
    def dropped(self) -> torch.Tensor:
        return (~self.kept_BTK).sum()


class TopKRouter(nn.Module):
    def __init__(self, d_model: int, n_experts: int, top_k: int, score_func: str = "softmax",
                 renormalize: bool = True, capacity_factor: float | None = None):
        super().__init__()
        self.n_experts, self.top_k, self.score_func = n_experts, top_k, score_func
        self.renormalize, self.capacity_factor = renormalize, capacity_factor
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        # Auxiliary-loss-free balance (DeepSeek-V3): added to the scores for the choice only.
        # Persistent: a resumed run goes on choosing as the saved one did.
        self.register_buffer("expert_bias", torch.zeros(n_experts))

    def forward(self, x_BTD: torch.Tensor) -> Routing:
        logits_BTE = self.gate(x_BTD)
        logits_BTE = logits_BTE.to(torch.promote_types(logits_BTE.dtype, torch.float32))
        if self.score_func == "softmax":
            scores_BTE = torch.softmax(logits_BTE, dim=-1)
            probs_BTE = scores_BTE
        else:
            scores_BTE = torch.sigmoid(logits_BTE)
            probs_BTE = scores_BTE / scores_BTE.sum(-1, keepdim=True)
        experts_BTK = self.choose(scores_BTE.detach())
        weights_BTK = scores_BTE.gather(-1, experts_BTK)
        if self.renormalize:
            weights_BTK = weights_BTK / weights_BTK.sum(-1, keepdim=True)
        return Routing(experts_BTK, weights_BTK, self.keep(experts_BTK), probs_BTE)

    def choose(self, scores_BTE: torch.Tensor) -> torch.Tensor:
        """The top_k experts of score + bias; equal values go to the lower index."""
        biased_BTE = scores_BTE + self.expert_bias.to(scores_BTE.dtype)
        return torch.sort(biased_BTE, dim=-1, descending=True, stable=True).indices[..., :self.top_k]

    def capacity(self, seq_len: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts)

    def keep(self, experts_BTK: torch.Tensor) -> torch.Tensor:
        """Which pairs stay within their expert's capacity in their sequence (all when dropless)."""
        B, T, K = experts_BTK.shape
        capacity = self.capacity(T)
        if capacity is None:
            return torch.ones_like(experts_BTK, dtype=torch.bool)
        # Each pair's rank among its (sequence, expert)'s pairs in position order: pairs flattened
        # in (b, t, k) order and stably sorted by sequence and expert keep position order (a token
        # picks an expert once).
        group_P = (torch.arange(B, device=experts_BTK.device).view(B, 1, 1) * self.n_experts + experts_BTK).flatten()
        order_P = torch.sort(group_P, stable=True).indices
        sizes_G = torch.zeros(B * self.n_experts, dtype=torch.long, device=group_P.device)
        sizes_G.scatter_add_(0, group_P, torch.ones_like(group_P))
        starts_G = torch.cumsum(sizes_G, 0) - sizes_G
        rank_P = torch.empty_like(group_P)
        rank_P[order_P] = torch.arange(group_P.numel(), device=group_P.device) - starts_G[group_P[order_P]]
        return (rank_P < capacity).view(B, T, K)


def expert_counts(experts_BTK: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(B, E): how many of each sequence's tokens chose each expert."""
    B = experts_BTK.shape[0]
    counts_BE = torch.zeros(B, n_experts, dtype=torch.long, device=experts_BTK.device)
    flat_BX = experts_BTK.reshape(B, -1)
    return counts_BE.scatter_add_(1, flat_BX, torch.ones_like(flat_BX))


def sequence_balance_loss(routing: Routing, n_experts: int) -> torch.Tensor:
    """(B,): each sequence's sum over experts of f_i * P_i (DeepSeek-V3's complementary
    sequence-wise loss, before its coefficient): f_i = E / (K T) x the sequence's tokens that
    chose expert i (capacity drops not subtracted: the router's choice is what it balances),
    P_i = the mean over the sequence of expert i's normalised score. 1 when perfectly even."""
    _, T, K = routing.experts_BTK.shape
    f_BE = expert_counts(routing.experts_BTK, n_experts).to(routing.probs_BTE.dtype) * (n_experts / (K * T))
    return (f_BE * routing.probs_BTE.mean(dim=1)).sum(-1)

"""A mixture-of-experts feed-forward layer (single device; parallelism is applied from outside).

    route -> dispatcher.routed: the (token, expert) pairs sorted by expert -> experts
          -> back to token order, weighted by the gates, summed per token
    (+ the shared experts, run on every token)

The routing rules (top-k choice, tie-break, capacity dropping) are in moe_router.py, the
experts and the identity dispatcher in moe_experts.py.

Seams for expert parallelism:
- `layer.dispatcher.routed(x_ND, experts_NK, weights_NK, experts) -> out_ND`: the routed part,
  Σ_k weights · expert_k(x) per token, a dropped choice being expert −1. The default,
  `LocalDispatcher`, sorts the (token, expert) pairs by expert and runs them in one call;
  expert parallelism's sends each token once per rank holding any of its experts.
- `layer.experts` (`GroupedExperts`) may hold a contiguous slice of the experts:
  `first_expert`, `local_experts`, weights w1/w3 (e, D, F) and w2 (e, F, D); `n_experts` is the
  layer's total. The router (`layer.router.gate`, `expert_bias`) stays whole on every rank.
- `layer.global_sequences`: the divisor of the balance loss (None: this call's batch size). Its
  gradient is applied with weight 1 whatever the loop does to its own loss, so set it to the
  number of sequences the step's gradient is the mean over as this rank's gradient is summed:
  the global batch where ranks' gradients are summed, global batch / dp where they are averaged.
- `update_router_bias(model, reduce)`: `reduce` sums the step's counts over ranks.
- Statistics: `layer.tokens_per_expert` (E,) and `layer.dropped_pairs`, summed over the
  training forwards since the last `update_router_bias`; `layer.last_aux_loss`. A forward re-run
  by activation checkpointing counts again (every count doubles: the bias rule's signs do not
  change).

Shape legend:
    B batch   T sequence position   N tokens (B T)   D d_model   E experts   K experts per token
    P pairs (N K)   S kept pairs, sorted by expert
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from paratrain.models.llama import SwiGLU
from paratrain.models.moe_config import MoEConfig
from paratrain.models.moe_experts import GroupedExperts, LocalDispatcher
from paratrain.models.moe_router import Routing, TopKRouter, sequence_balance_loss



class _AttachAuxLoss(torch.autograd.Function):
    """The layer's output unchanged; in backward, the output's gradient passes through and the
    attached loss gets gradient 1: the loss is trained without the loop ever adding it."""

    @staticmethod
    def forward(ctx, out_BTD: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype, ctx.aux_device = aux_loss.dtype, aux_loss.device
        return out_BTD

    @staticmethod
    def backward(ctx, grad_BTD: torch.Tensor):
        return grad_BTD, torch.ones((), dtype=ctx.aux_dtype, device=ctx.aux_device)


class MoEFeedForward(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.aux_loss_coef, self.bias_update_rate = config.aux_loss_coef, config.bias_update_rate
        self.router = TopKRouter(config.d_model, config.n_experts, config.top_k, config.score_func,
                                 config.renormalize, config.capacity_factor)
        self.experts = GroupedExperts(config.d_model, config.d_expert, config.n_experts, config.expert_compute)
        width = config.n_shared_experts * config.d_expert
        self.shared = SwiGLU(dataclasses.replace(config.dense_config(), d_mlp=width)) if width else None
        self.dispatcher = LocalDispatcher()
        self.global_sequences: int | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.register_buffer("tokens_per_expert", torch.zeros(config.n_experts, dtype=torch.long), persistent=False)
        self.step_load: tuple[torch.Tensor, int] | None = None  # (tokens per expert, dropped pairs) of the last step
        self.register_buffer("dropped_pairs", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        routing = self.router(x_BTD)
        out_BTD = self.routed(x_BTD.reshape(B * T, D), routing).view(B, T, D)
        if self.shared is not None:
            out_BTD = out_BTD + self.shared(x_BTD)
        if self.training:
            self._count(routing)
            if self.aux_loss_coef and torch.is_grad_enabled():
                out_BTD = _AttachAuxLoss.apply(out_BTD, self.aux_loss(routing))
        return out_BTD

    def routed(self, x_ND: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed experts' weighted sum for each token, by the dispatcher (a dropped choice
        is expert −1)."""
        kept_NK = routing.kept_BTK.reshape(-1, self.top_k)
        experts_NK = torch.where(kept_NK, routing.experts_BTK.reshape(-1, self.top_k), -1)
        return self.dispatcher.routed(x_ND, experts_NK, routing.weights_BTK.reshape(-1, self.top_k), self.experts)

    def aux_loss(self, routing: Routing) -> torch.Tensor:
        """coef x the mean over the batch's sequences of the sequence-wise balance loss (the
        divisor is global_sequences when set); its value is kept, detached, for the log."""
        per_sequence_B = sequence_balance_loss(routing, self.n_experts)
        sequences = self.global_sequences or per_sequence_B.shape[0]
        loss = self.aux_loss_coef * per_sequence_B.sum() / sequences
        self.last_aux_loss = loss.detach()
        return loss

    def _count(self, routing: Routing) -> None:
        with torch.no_grad():
            experts_P = routing.experts_BTK.reshape(-1)
            self.tokens_per_expert.scatter_add_(0, experts_P, torch.ones_like(experts_P))
            self.dropped_pairs += routing.dropped


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def update_router_bias(model: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """After the optimizer step: each MoE layer's expert_bias += rate x sign(mean(counts) -
    counts) (under-loaded experts rise, over-loaded ones fall), then its counts and dropped
    pairs start again from zero. `reduce` sums a tensor over the ranks that share the step (None:
    this process's counts are the step's). The step's counts and dropped pairs are kept as
    `layer.step_load` for the log."""
    with torch.no_grad():
        for layer in moe_layers(model):
            counts_E = layer.tokens_per_expert.clone()
            dropped = layer.dropped_pairs.clone().view(1)
            if reduce is not None:
                counts_E, dropped = reduce(counts_E), reduce(dropped)
            layer.step_load = (counts_E.clone(), int(dropped))  # the finished step's, for the log
            if layer.bias_update_rate:
                counts_E = counts_E.to(layer.router.expert_bias.dtype)
                layer.router.expert_bias += layer.bias_update_rate * torch.sign(counts_E.mean() - counts_E)
            layer.tokens_per_expert.zero_()
            layer.dropped_pairs.zero_()


def moe_statistics(model: nn.Module) -> list[dict]:
    """Per MoE layer, for the log: tokens per expert and dropped pairs since the last bias
    update (the step so far), and the last balance loss (None when off)."""
    return [{"tokens_per_expert": layer.tokens_per_expert.tolist(), "dropped_pairs": int(layer.dropped_pairs),
             "aux_loss": None if layer.last_aux_loss is None else float(layer.last_aux_loss)}
            for layer in moe_layers(model)]

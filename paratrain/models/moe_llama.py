"""A Llama whose feed-forward layers are mixtures of experts (Mixtral, OLMoE, DeepSeek-style).

The blocks are llama.py's, each MoE layer's `mlp` swapped for an `MoEFeedForward` (moe.py); the
names stay the Llama's, so the plans read alike: `tok_emb`, `layers[i].{attn_norm, attn.{wq, wk,
wv, wo}, mlp_norm, mlp}`, `norm`, `output`, where an MoE layer's mlp is
`{router.gate, experts.{w1, w2, w3}, shared.{w1, w2, w3}}` and a dense layer's is the SwiGLU.

Its configuration, MoEConfig, is in moe_config.py (re-exported here).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paratrain.models.llama import LlamaBlock, LlamaConfig, RMSNorm, llama_parameter_count
from paratrain.models.moe import MoEFeedForward
from paratrain.models.moe_config import MoEConfig
from paratrain.models.moe_experts import GroupedExperts

__all__ = ["MoEConfig", "MoELlama", "moe_parameter_count", "moe_parameter_counts"]


def _block(config: MoEConfig, dense: LlamaConfig, moe: bool) -> LlamaBlock:
    block = LlamaBlock(dense)
    if moe:  # the Llama block, one forward for both kinds; its feed-forward swapped in place
        block.mlp = MoEFeedForward(config)
    return block


class MoELlama(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        config.validate()
        self.config = config
        dense, moe = config.dense_config(), set(config.moe_layer_indices())
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(_block(config, dense, i in moe) for i in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.output = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_embeddings:
            self.output.weight = self.tok_emb.weight

    def _init_weights(self) -> None:
        """As the Llama's: Normal(0, 0.02), residual projections (wo, w2, the experts' w2)
        scaled by depth, drawn from torch's global RNG in module order."""
        std = 0.02
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=resid_std if name.endswith(("wo", "w2")) else std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, GroupedExperts):
                for weight in (module.w1, module.w3):
                    nn.init.normal_(weight, std=std)
                nn.init.normal_(module.w2, std=resid_std)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        if idx_BT.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length {idx_BT.shape[1]} exceeds block_size {self.config.block_size}")
        x_BTD = self.tok_emb(idx_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD)
        return self.output(self.norm(x_BTD))  # logits_BTV


def moe_parameter_counts(config: MoEConfig) -> tuple[int, int]:
    """(total, active) parameters of `MoELlama(config)`, computed without building it; active:
    those one token's forward uses (every dense weight, the router, top_k routed experts, the
    shared experts), as MoE models' published 'active' figures count them."""
    config.validate()
    d, n_moe = config.d_model, len(config.moe_layer_indices())
    expert = 3 * d * config.d_expert
    router_and_shared = d * config.n_experts + config.n_shared_experts * expert
    dense_total = llama_parameter_count(config.dense_config()) - n_moe * 3 * d * config.d_mlp
    total = dense_total + n_moe * (router_and_shared + config.n_experts * expert)
    active = dense_total + n_moe * (router_and_shared + config.top_k * expert)
    return total, active


def moe_parameter_count(config: MoEConfig) -> int:
    return moe_parameter_counts(config)[0]

"""A Llama whose feed-forward layers are mixtures of experts (Mixtral, OLMoE, DeepSeek-style).

The blocks are llama.py's, each MoE layer's `mlp` swapped for an `MoEFeedForward` (moe.py); the
names stay the Llama's, so the plans read alike: `tok_emb`, `layers[i].{attn_norm, attn.{wq, wk,
wv, wo}, mlp_norm, mlp}`, `norm`, `output`, where an MoE layer's mlp is
`{router.gate, experts.{w1, w2, w3}, shared.{w1, w2, w3}}` and a dense layer's is the SwiGLU.

Its configuration, MoEConfig, is in moe_config.py (re-exported here).
"""

from __future__ import annotations


from torch import nn

from paratrain.models.llama import Llama, LlamaBlock, LlamaConfig, llama_parameter_count
from paratrain.models.moe import MoEFeedForward
from paratrain.models.moe_config import MoEConfig
from paratrain.models.moe_experts import GroupedExperts

__all__ = ["MoEConfig", "MoELlama", "moe_parameter_count", "moe_parameter_counts"]


def _block(config: MoEConfig, dense: LlamaConfig, moe: bool) -> LlamaBlock:
    block = LlamaBlock(dense)
    if moe:  # the Llama block, one forward for both kinds; its feed-forward swapped in place
        block.mlp = MoEFeedForward(config)
    return block


class MoELlama(Llama):
    """The Llama with some feed-forwards swapped for MoE layers; its forward, the Llama's."""

    def _blocks(self, config: MoEConfig) -> list[nn.Module]:
        dense, moe = config.dense_config(), set(config.moe_layer_indices())
        return [_block(config, dense, i in moe) for i in range(config.n_layer)]

    def _init_other(self, module: nn.Module, std: float, resid_std: float) -> None:
        """As the Llama's projections: the experts' w1 and w3 at std, their w2 (the residual
        projection) scaled by depth."""
        if isinstance(module, GroupedExperts):
            for weight in (module.w1, module.w3):
                nn.init.normal_(weight, std=std)
            nn.init.normal_(module.w2, std=resid_std)


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

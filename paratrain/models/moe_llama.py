"""A Llama whose feed-forward layers are mixtures of experts (Mixtral, OLMoE, DeepSeek-style).

The blocks are llama.py's, each MoE layer's `mlp` swapped for an `MoEFeedForward` (moe.py); the
names stay the Llama's, so the plans read alike: `tok_emb`, `layers[i].{attn_norm, attn.{wq, wk,
wv, wo}, mlp_norm, mlp}`, `norm`, `output`, where an MoE layer's mlp is
`{router.gate, experts.{w1, w2, w3}, shared.{w1, w2, w3}}` and a dense layer's is the SwiGLU.

MoEConfig repeats LlamaConfig's fields rather than subclassing it: code that treats any
LlamaConfig as a dense Llama (the memory estimate, the planner's shapes) must not take an MoE
model for one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.models.llama import LlamaBlock, LlamaConfig, RMSNorm, llama_parameter_count
from paratrain.models.mlp import positive_int_problems, raise_if_invalid
from paratrain.models.moe import MoEFeedForward
from paratrain.models.moe_experts import EXPERT_COMPUTES, GroupedExperts
from paratrain.models.moe_router import SCORE_FUNCS


@dataclass
class MoEConfig:
    # The Llama's fields (see LlamaConfig); d_mlp is the dense layers' SwiGLU width.
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 4
    n_kv_head: int = 2
    d_mlp: int = 192
    vocab_size: int = 256
    block_size: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # The experts.
    n_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts each token goes to
    d_expert: int = 64  # each expert's SwiGLU hidden width
    n_shared_experts: int = 1  # experts every token goes to (one SwiGLU n_shared x d_expert wide)
    moe_every: int = 1  # every moe_every-th layer after the first dense ones is MoE (1: all of them)
    first_dense_layers: int = 0  # leading dense layers (DeepSeek-V3 has 3: early layers balance badly)
    score_func: str = "softmax"  # softmax (Mixtral, OLMoE) or sigmoid (DeepSeek-V3)
    renormalize: bool = True  # chosen gate weights divided by their sum (Mixtral yes, OLMoE no)
    aux_loss_coef: float = 0.01  # sequence-wise balance loss coefficient; 0 = off
    bias_update_rate: float = 0.0  # auxiliary-loss-free balance (update_router_bias); 0 = off
    capacity_factor: float | None = None  # None: dropless; else per sequence and expert
    expert_compute: str = "grouped"  # grouped (one grouped_mm per weight) or loop (the reference)

    def validate(self) -> None:
        problems = positive_int_problems(self, ("n_experts", "top_k", "d_expert", "moe_every"))
        try:
            self.dense_config().validate()
        except ValueError as error:  # its one-line problems, told as this config's
            problems.append(str(error).removeprefix("invalid LlamaConfig: "))
        for name in ("n_shared_experts", "first_dense_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"{name} must be a non-negative integer, got {value!r}")
        if not problems and self.top_k > self.n_experts:
            problems.append(f"top_k ({self.top_k}) must be at most n_experts ({self.n_experts})")
        if not problems and not self.moe_layer_indices():
            problems.append(f"first_dense_layers ({self.first_dense_layers}) leaves no MoE layer in {self.n_layer}")
        problems += self._choice_problems()
        raise_if_invalid(self, problems)

    def _choice_problems(self) -> list[str]:
        problems = []
        if self.score_func not in SCORE_FUNCS:
            problems.append(f"score_func must be one of {', '.join(SCORE_FUNCS)}, got {self.score_func!r}")
        if self.expert_compute not in EXPERT_COMPUTES:
            problems.append(f"expert_compute must be one of {', '.join(EXPERT_COMPUTES)}, got {self.expert_compute!r}")
        if not isinstance(self.renormalize, bool):
            problems.append(f"renormalize must be true or false, got {self.renormalize!r}")
        for name in ("aux_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                problems.append(f"{name} must be a number >= 0, got {value!r}")
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
            problems.append(f"capacity_factor must be a number > 0 or null (dropless), got {factor!r}")
        return problems

    def dense_config(self) -> LlamaConfig:
        """The Llama fields: what the attention, norms and dense layers are built from."""
        return LlamaConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LlamaConfig)})

    def moe_layer_indices(self) -> list[int]:
        return [i for i in range(self.first_dense_layers, self.n_layer)
                if (i - self.first_dense_layers) % self.moe_every == 0]


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

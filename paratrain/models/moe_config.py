"""The configuration of a mixture-of-experts Llama (moe_llama.py builds it, moe.py's layer reads
its expert fields), apart from both so that neither imports the other for it.

MoEConfig repeats LlamaConfig's fields rather than subclassing it: code that treats any
LlamaConfig as a dense Llama (the memory estimate, the planner's shapes) must not take an MoE
model for one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paratrain.models.llama import LlamaConfig
from paratrain.models.mlp import positive_int_problems, raise_if_invalid
from paratrain.models.moe_experts import EXPERT_COMPUTES
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

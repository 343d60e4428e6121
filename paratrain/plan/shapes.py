"""The shape of a GPT or Llama as the cost formulas see it, and named shapes to plan for.

Names follow the papers the formulas come from: l layers, h hidden size, a attention heads,
s sequence length, V vocabulary, m the MLP's inner width (4h in every GPT here). A Llama
(gated=True) differs where its FLOPs and parameters do: grouped-query attention's key/value
projections are h x (h g / a) for g kv_heads, SwiGLU has three h x m matrices instead of two,
and there are no biases or learned positions, with one-vector RMSNorms.

A mixture of experts (experts > 0, a Llama) replaces the SwiGLU of its MoE layers (every
moe_every-th after the first_dense ones) with a router (h x E), E routed experts and the shared
experts, each a SwiGLU expert_mlp wide; a token uses the router, top_k routed experts and the
shared ones. As paratrain's MoE plan (models/plans.py) has it, tensor parallelism splits the
attention only: every MLP of an MoE model, dense or not, stays whole on each tp rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.models import PRESETS, GPTConfig, LlamaConfig, MoEConfig


@dataclass(frozen=True)
class GPTShape:
    layers: int   # l
    hidden: int   # h
    heads: int    # a
    seq: int      # s: the sequence length trained on
    vocab: int    # V
    mlp: int = 0  # m; 0 means 4h, as in GPT-2/3 and Megatron
    kv_heads: int = 0  # g: key/value heads (grouped-query attention); 0 means a, as in a GPT
    gated: bool = False  # a Llama: SwiGLU, no biases, no learned positions, RMSNorm
    experts: int = 0  # E: routed experts per MoE layer; 0: a dense model
    top_k: int = 0  # k: routed experts each token goes to
    expert_mlp: int = 0  # each expert's SwiGLU width
    shared_experts: int = 0  # experts every token goes to
    moe_every: int = 1  # every moe_every-th layer after the first dense ones is MoE
    first_dense: int = 0  # leading dense layers

    def __post_init__(self):
        if self.mlp == 0:
            object.__setattr__(self, "mlp", 4 * self.hidden)
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        problems = [f"{name} must be a positive integer, got {getattr(self, name)!r}"
                    for name in ("layers", "hidden", "heads", "seq", "vocab", "mlp", "kv_heads")
                    if not isinstance(getattr(self, name), int) or getattr(self, name) < 1]
        if not problems and self.hidden % self.heads:
            problems.append(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if not problems and self.heads % self.kv_heads:
            problems.append(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if not problems and not self.gated and self.kv_heads != self.heads:
            # paratrain's GPT, and so its parameter and memory formulas, has one k/v head per head
            problems.append(f"a GPT has as many kv_heads as heads ({self.heads}), got {self.kv_heads}: "
                            "plan grouped-query attention from a Llama")
        if not problems and self.experts:
            problems += self._moe_problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _moe_problems(self) -> list[str]:
        if not self.gated:
            return ["a mixture of experts is planned from a Llama (gated)"]
        problems = [f"{name} must be a positive integer, got {getattr(self, name)!r}"
                    for name in ("top_k", "expert_mlp", "moe_every") if getattr(self, name) < 1]
        problems += [f"{name} must be a non-negative integer, got {getattr(self, name)!r}"
                     for name in ("shared_experts", "first_dense") if getattr(self, name) < 0]
        if not problems and self.top_k > self.experts:
            problems.append(f"top_k ({self.top_k}) must be at most the experts ({self.experts})")
        if not problems and not self.moe_layers:
            problems.append(f"first_dense ({self.first_dense}) leaves no MoE layer in {self.layers}")
        return problems

    @classmethod
    def from_config(cls, config) -> GPTShape:
        """From a GPTConfig, a LlamaConfig or an MoEConfig."""
        if isinstance(config, MoEConfig):
            return cls(config.n_layer, config.d_model, config.n_head, config.block_size, config.vocab_size,
                       config.d_mlp, config.n_kv_head, gated=True, experts=config.n_experts, top_k=config.top_k,
                       expert_mlp=config.d_expert, shared_experts=config.n_shared_experts,
                       moe_every=config.moe_every, first_dense=config.first_dense_layers)
        if isinstance(config, LlamaConfig):
            return cls(config.n_layer, config.d_model, config.n_head, config.block_size, config.vocab_size,
                       config.d_mlp, config.n_kv_head, gated=True)
        return cls(config.n_layer, config.d_model, config.n_head, config.block_size, config.vocab_size,
                   config.d_mlp)

    def attention_weights(self) -> int:
        """Elements of one layer's attention matrices: q and out h x h; k and v h x (h g / a)."""
        h = self.hidden
        return 2 * h * h + 2 * h * (h * self.kv_heads // self.heads)

    def mlp_weights(self, moe: bool = False, active: bool = True) -> int:
        """Elements of one layer's MLP matrices: up and down, and SwiGLU's gate; of an MoE
        layer's, the router, the shared experts and the routed ones, top_k (active) or all E."""
        if not moe:
            return (3 if self.gated else 2) * self.hidden * self.mlp
        routed = self.top_k if active else self.experts
        return self.hidden * self.experts + (self.shared_experts + routed) * self.expert_weights()

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has a mixture of experts for its MLP."""
        return (self.experts > 0 and layer >= self.first_dense
                and (layer - self.first_dense) % self.moe_every == 0)

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.layers))

    def expert_weights(self) -> int:
        """Elements of one expert: a SwiGLU expert_mlp wide (gate, up, down)."""
        return 3 * self.hidden * self.expert_mlp

    def parameters(self, active: bool = False) -> int:
        """Parameters of paratrain's GPT (biases, untied head, learned positions), Llama or MoE
        Llama (untied head) of this shape; `active`: those one token's forward uses (top_k of an
        MoE layer's routed experts), as MoE models' published 'active' counts them."""
        h, m = self.hidden, self.mlp
        if self.gated:
            blocks = sum(self.attention_weights() + self.mlp_weights(self.is_moe(i), active) + 2 * h  # two RMSNorms
                         for i in range(self.layers))
            return self.vocab * h + blocks + h + h * self.vocab
        block = (4 * h * h + 4 * h) + (2 * h * m + m + h) + 4 * h  # attention, MLP, two layer norms
        return self.vocab * h + self.seq * h + self.layers * block + 2 * h + h * self.vocab


# Published configurations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
# Transformer Models"), Table 3; the vocabulary is GPT-2's 50257 padded to 51200 as Megatron does
# (the V Narayanan et al. 2021 use in their FLOPs formula).
PUBLISHED = {
    "gpt-22b": GPTShape(layers=48, hidden=6144, heads=64, seq=2048, vocab=51200),
    "gpt3-175b": GPTShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200),
    "mt-nlg-530b": GPTShape(layers=105, hidden=20480, heads=128, seq=2048, vocab=51200),
    "gpt-1t": GPTShape(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200),
}


PLANNABLE = (GPTConfig, LlamaConfig, MoEConfig)  # the configs a GPTShape is made from


def shape_names() -> list[str]:
    return [name for name, p in PRESETS.items() if isinstance(p, PLANNABLE)] + list(PUBLISHED)


def named_shape(name: str) -> GPTShape:
    """A paratrain preset (gpt-*, llama-*, tinyllama-1.1b, the MoE ones) or a published model."""
    if name in PUBLISHED:
        return PUBLISHED[name]
    preset = PRESETS.get(name)
    if not isinstance(preset, PLANNABLE):
        raise ValueError(f"unknown model shape {name!r}; valid: {', '.join(shape_names())}")
    return GPTShape.from_config(preset)

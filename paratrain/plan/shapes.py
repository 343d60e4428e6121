"""The shape of a GPT or Llama as the cost formulas see it, and named shapes to plan for.

Names follow the papers the formulas come from: l layers, h hidden size, a attention heads,
s sequence length, V vocabulary, m the MLP's inner width (4h in every GPT here). A Llama
(gated=True) differs where its FLOPs and parameters do: grouped-query attention's key/value
projections are h x (h g / a) for g kv_heads, SwiGLU has three h x m matrices instead of two,
and there are no biases or learned positions, with one-vector RMSNorms.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.models import PRESETS, GPTConfig, LlamaConfig


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
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_config(cls, config) -> GPTShape:
        """From a GPTConfig or a LlamaConfig."""
        if isinstance(config, LlamaConfig):
            return cls(config.n_layer, config.d_model, config.n_head, config.block_size, config.vocab_size,
                       config.d_mlp, config.n_kv_head, gated=True)
        return cls(config.n_layer, config.d_model, config.n_head, config.block_size, config.vocab_size,
                   config.d_mlp)

    def attention_weights(self) -> int:
        """Elements of one layer's attention matrices: q and out h x h; k and v h x (h g / a)."""
        h = self.hidden
        return 2 * h * h + 2 * h * (h * self.kv_heads // self.heads)

    def mlp_weights(self) -> int:
        """Elements of one layer's MLP matrices: up and down, and SwiGLU's gate."""
        return (3 if self.gated else 2) * self.hidden * self.mlp

    def parameters(self) -> int:
        """Parameters of paratrain's GPT (biases, untied head, learned positions) or Llama
        (untied head) of this shape."""
        h, m = self.hidden, self.mlp
        if self.gated:
            block = self.attention_weights() + self.mlp_weights() + 2 * h  # two RMSNorms
            return self.vocab * h + self.layers * block + h + h * self.vocab
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


def shape_names() -> list[str]:
    return [name for name, p in PRESETS.items() if isinstance(p, (GPTConfig, LlamaConfig))] + list(PUBLISHED)


def named_shape(name: str) -> GPTShape:
    """A paratrain preset (gpt-*, llama-*, tinyllama-1.1b) or a published model."""
    if name in PUBLISHED:
        return PUBLISHED[name]
    preset = PRESETS.get(name)
    if not isinstance(preset, (GPTConfig, LlamaConfig)):
        raise ValueError(f"unknown model shape {name!r}; valid: {', '.join(shape_names())}")
    return GPTShape.from_config(preset)

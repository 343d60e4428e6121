"""The parallelism plans of our own models, beside the models (as torchtitan keeps each model's
parallelize.py beside its model.py). A plan is data: module paths to tensor-parallel styles,
where sequence parallelism gathers, and how the pipeline reads the model as a list of blocks.
`paratrain.parallel.plan` applies it; a user's model comes with a plan of the same form (a
dict, or the same keys in YAML).

The models stay free of parallelism: the one thing here that is not a path is the GPT's
first pipeline layer, the sum of two embeddings, which no list of paths can express.
"""

from __future__ import annotations

import torch
from torch import nn


class GPTEmbedding(nn.Module):
    """Token plus position embedding: the GPT's first pipeline layer."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.tok_emb, self.pos_emb, self.emb_drop = gpt.tok_emb, gpt.pos_emb, gpt.emb_drop
        self.register_buffer("positions", gpt.positions, persistent=False)  # the GPT's own table

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return self.emb_drop(self.tok_emb(idx_BT) + self.pos_emb(self.positions[:idx_BT.shape[1]]))


GPT_PLAN = {
    "tensor_parallel": {
        "tok_emb": "vocab_embed",  # vocabulary ranges; the sum over ranks is the lookup
        "pos_emb": "replicate",  # under sequence parallelism each rank keeps its positions' rows
        "blocks.*.attn.qkv": {"style": "colwise", "parts": 3},  # [q | k | v]: whole heads per rank
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.up": "colwise",
        "blocks.*.mlp.down": "rowwise",
        "head": "vocab_head",  # logits stay sharded for the vocab-parallel loss
    },
    # Attention reads the sequence length from its input, so the gather is at its boundary.
    "sequence_parallel": {"gather_inputs": ["blocks.*.attn", "blocks.*.mlp", "head"]},
    "pipeline": {"blocks": "blocks", "before": [GPTEmbedding], "after": ["ln_f", "head"]},
    "context_parallel": {"attention": ["blocks.*.attn"], "positions": ["positions"]},
}

LLAMA_PLAN = {
    "tensor_parallel": {
        "tok_emb": "vocab_embed",
        "layers.*.attn.wq": "colwise",  # n_heads / tp query heads per rank ...
        "layers.*.attn.wk": "colwise",  # ... and n_kv_heads / tp key/value heads: the same groups
        "layers.*.attn.wv": "colwise",
        "layers.*.attn.wo": "rowwise",
        "layers.*.mlp.w1": "colwise",
        "layers.*.mlp.w3": "colwise",
        "layers.*.mlp.w2": "rowwise",
        "output": "vocab_head",
    },
    # Attention declares head_count_attrs (n_heads, n_kv_heads); said here too, for the reader.
    "head_counts": {"layers.*.attn": ["n_heads", "n_kv_heads"]},
    "sequence_parallel": {"gather_inputs": ["layers.*.attn", "layers.*.mlp", "output"]},
    "pipeline": {"blocks": "layers", "before": ["tok_emb"], "after": ["norm", "output"]},
    "context_parallel": {"attention": ["layers.*.attn"], "positions": ["layers.*.attn.positions"]},
}

# The MoE Llama: tensor parallelism splits the attention only; the experts stay whole here (how
# tp or expert parallelism divides them is the expert-parallel plan's to say). Sequence
# parallelism gathers before the whole mlp, router included: routing needs whole sequences for
# its per-sequence capacity and balance loss.
MOE_PLAN = {
    **LLAMA_PLAN,
    "tensor_parallel": {path: style for path, style in LLAMA_PLAN["tensor_parallel"].items() if ".mlp." not in path},
}


def default_plan(model: nn.Module) -> dict | None:
    """Our model's own plan, a transformers model's (hf_plans.py), or None for a model that has
    none (the MLPs, the CNN)."""
    from paratrain.models.gpt import GPT
    from paratrain.models.hf_plans import hf_plan
    from paratrain.models.llama import Llama
    from paratrain.models.moe_llama import MoELlama

    return {GPT: GPT_PLAN, Llama: LLAMA_PLAN, MoELlama: MOE_PLAN}.get(type(model)) or hf_plan(model)

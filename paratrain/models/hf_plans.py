"""The parallelism plans of transformers' causal LMs (models/hf_adapters.py), in the form of
models/plans.py, over transformers' own module paths.

Neither plan has a sequence_parallel section: transformers' decoder layers call their attention
with keyword arguments, where a gather at the attention's input cannot reach the hidden states,
and the rotary table is read at the layer's input, whose length sequence parallelism would cut.
`--sequence-parallel` is therefore refused for these models, in one line.
"""

from __future__ import annotations

from torch import nn

# Llama, Mistral, Qwen2 and Qwen3 share the layout: embed_tokens, layers (self_attn, mlp), norm, lm_head.
DECODER_PLAN = {
    "tensor_parallel": {
        "model.embed_tokens": "vocab_embed",
        "model.layers.*.self_attn.q_proj": "colwise",  # num_heads / tp query heads per rank ...
        "model.layers.*.self_attn.k_proj": "colwise",  # ... and num_key_value_heads / tp: the same groups
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "vocab_head",
    },
    # Recorded by the adapter for this check and division; transformers reshapes by head_dim.
    "head_counts": {"model.layers.*.self_attn": ["num_heads", "num_key_value_heads"]},
    "pipeline": {"blocks": "model.layers", "before": ["model.embed_tokens"], "after": ["model.norm", "lm_head"]},
    "context_parallel": {"attention": ["model.layers.*.self_attn"], "positions": ["positions"]},
}


def _gpt2_embedding(lm: nn.Module) -> nn.Module:
    from paratrain.models.hf_adapters import GPT2Embedding

    return GPT2Embedding(lm)


# GPT-2's projections are transformers' Conv1D (weight stored (in, out)); the tensor-parallel layers
# split them in that orientation (layers.linear_shape), so every parameter keeps GPT-2's name and
# layout. c_attn is [q | k | v]: three fused parts. The attention splits its projection's output
# by `split_size` (the width of q), which tp divides. With the head tied to wte, as GPT-2's is by
# default, pp must be 1 (pipeline_problems).
GPT2_PLAN = {
    "tensor_parallel": {
        "transformer.wte": "vocab_embed",
        "transformer.h.*.attn.c_attn": {"style": "colwise", "parts": 3},
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "vocab_head",
    },
    "head_counts": {"transformer.h.*.attn": ["split_size"]},
    "pipeline": {"blocks": "transformer.h", "before": [_gpt2_embedding], "after": ["transformer.ln_f", "lm_head"]},
    "context_parallel": {"attention": ["transformer.h.*.attn"], "positions": ["positions"]},
}


def hf_plan(model: nn.Module) -> dict | None:
    """The plan of a transformers model adapted by hf_adapters, or None for any other model."""
    from paratrain.models.hf_adapters import HFDecoderLM, HFGPT2LM

    return {HFDecoderLM: DECODER_PLAN, HFGPT2LM: GPT2_PLAN}.get(type(model))

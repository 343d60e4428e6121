"""A `transformers` causal LM as our language models are: token ids (B, T) -> logits (B, T, V), read
by a plan as `before`, `blocks`, `after` modules that each take and return one tensor.

The model is transformers' own, built from its config (models/hf_model.py); nothing here changes
transformers' files. What is adapted, on the built instance:

- The wrapper holds transformers' top-level children as its own (`model` and `lm_head`, or GPT-2's
  `transformer` and `lm_head`), so the parameters keep transformers' names
  (`model.layers.0.self_attn.q_proj.weight`), and a tied head stays one Parameter with the embedding.
  Our forward walks those children (embedding, each decoder layer, final norm, head) and returns the
  logits: the loss is ours (cross-entropy on the logits), never transformers'.
- Decoder layers (Llama, Mistral, Qwen2, Qwen3) want the rotary (cos, sin) of their tokens'
  positions besides the hidden states. A forward pre-hook (`RotaryInputs`) supplies it when a layer
  is called with the hidden states alone, from the model's own `rotary_emb` and the wrapper's
  `positions` buffer (`positions[:T]`, which context parallelism cuts to each rank's tokens). No
  attention mask is passed: transformers' SDPA attention then calls
  `scaled_dot_product_attention(is_causal=True)`, exactly what its own forward does for an
  unpadded batch, and what context parallelism captures. Eager attention would take no mask as
  "attend everywhere", so the SDPA implementation is forced.
- Nothing else: every parameter keeps transformers' name, shape and layout, so a checkpoint is
  transformers' state dict as it is. (GPT-2's projections stay transformers' `Conv1D`, weight
  stored (in, out); the tensor-parallel layers split it in that orientation.)
- Each decoder attention module records its head counts (`num_heads`, `num_key_value_heads`):
  transformers reshapes by head_dim and reads neither, but the plan's check divides them, refusing
  a tp that would cut a head.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryInputs:
    """Forward pre-hook of a decoder layer: called with the hidden states alone (as the pipeline
    calls a block), it adds the rotary (cos, sin) of positions[:T]. Given position embeddings
    (transformers' own forward), it changes nothing."""

    def __init__(self, lm: nn.Module):
        self.lm = lm  # the wrapper: its current `positions` and the model's `rotary_emb`

    def __call__(self, layer, args, kwargs):
        if kwargs.get("position_embeddings") is not None or len(args) != 1:
            return None
        x_BTD = args[0]
        positions_1T = self.lm.positions[:x_BTD.shape[1]].to(x_BTD.device).unsqueeze(0)
        cos_sin = self.lm.model.rotary_emb(x_BTD, positions_1T)
        return args, {**kwargs, "position_embeddings": cos_sin}


class HFDecoderLM(nn.Module):
    """A Llama-style transformers causal LM (embed_tokens, layers, norm, lm_head)."""

    def __init__(self, hf_model: nn.Module, block_size: int):
        super().__init__()
        self.model, self.lm_head = hf_model.model, hf_model.lm_head
        self.config = hf_model.config  # transformers' config: an exporter writes it as config.json
        self.vocab_size, self.block_size = hf_model.config.vocab_size, block_size
        self.register_buffer("positions", torch.arange(block_size), persistent=False)
        for layer in self.model.layers:
            layer.register_forward_pre_hook(RotaryInputs(self), with_kwargs=True)
            record_head_counts(layer.self_attn, hf_model.config.num_attention_heads,
                               hf_model.config.num_key_value_heads)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        x_BTD = self.model.embed_tokens(idx_BT)
        for layer in self.model.layers:
            x_BTD = layer(x_BTD)
        return self.lm_head(self.model.norm(x_BTD))  # logits_BTV


class GPT2Embedding(nn.Module):
    """Token plus position embedding, then dropout: GPT-2's first pipeline layer."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = lm.transformer.wte, lm.transformer.wpe, lm.transformer.drop
        self.register_buffer("positions", lm.positions, persistent=False)  # the wrapper's, cut by cp

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return gpt2_embed(self.wte, self.wpe, self.drop, self.positions, idx_BT)


def gpt2_embed(wte, wpe, drop, positions, idx_BT: torch.Tensor) -> torch.Tensor:
    return drop(wte(idx_BT) + wpe(positions[:idx_BT.shape[1]]))


class HFGPT2LM(nn.Module):
    """transformers' GPT2LMHeadModel (transformer: wte, wpe, h, ln_f; lm_head tied to wte)."""

    def __init__(self, hf_model: nn.Module, block_size: int):
        super().__init__()
        self.transformer, self.lm_head = hf_model.transformer, hf_model.lm_head
        self.config = hf_model.config
        self.vocab_size, self.block_size = hf_model.config.vocab_size, block_size
        self.register_buffer("positions", torch.arange(block_size), persistent=False)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x_BTD = gpt2_embed(t.wte, t.wpe, t.drop, self.positions, idx_BT)
        for block in t.h:
            x_BTD = block(x_BTD)  # no mask: SDPA's is_causal, as transformers' unpadded forward
        return self.lm_head(t.ln_f(x_BTD))


def record_head_counts(attention: nn.Module, heads: int, kv_heads: int) -> None:
    """Head counts for the plan to check and divide (transformers' decoders read neither)."""
    attention.num_heads, attention.num_key_value_heads = heads, kv_heads

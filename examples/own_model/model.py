"""A small decoder written here, knowing nothing of paratrain: what a user brings.

No position embedding at all (a "NoPE" decoder: causal attention alone tells positions apart),
LayerNorm without bias, plain multi-head attention with separate query/key/value, a GELU MLP.
Its names are its own (embed, blocks[i].attention.query, ..., lm_head); plan.yaml maps them
to tensor-parallel styles and says how the pipeline reads it.

    paratrain train --model examples/own_model/model.py:build --plan examples/own_model/plan.yaml
"""

import math

import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads  # plan.yaml's head_counts divides it when the heads are split
        self.query, self.key, self.value = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, self.heads, -1).transpose(1, 2) for proj in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width, bias=False), nn.LayerNorm(width, bias=False)
        self.attention, self.ffn = Attention(width, heads), FeedForward(width, 4 * width)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, layers: int, width: int, heads: int):
        super().__init__()
        self.vocab_size, self.block_size = vocab_size, block_size  # paratrain reads these
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.final_norm = nn.LayerNorm(width, bias=False)
        self.lm_head = nn.Linear(width, vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("out.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens):  # (B, T) token ids -> (B, T, vocab_size) logits
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))


def build(vocab_size: int = 256, block_size: int = 64, layers: int = 4, width: int = 96, heads: int = 6):
    return TinyDecoder(vocab_size, block_size, layers, width, heads)

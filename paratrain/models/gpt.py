"""A nanoGPT-style decoder: pre-norm blocks of causal self-attention and a GELU MLP.

Every weight a parallelism would split is its own named Linear, so tensor and pipeline
parallelism can be applied from outside without touching this file:
`tok_emb`, `pos_emb`, `blocks[i].{ln1, attn.qkv, attn.proj, ln2, mlp.up, mlp.down}`, `ln_f`,
`head`.

Shape legend:
    B batch            T sequence position     D d_model
    H attention heads  K head dim (D / H)      M d_mlp          V vocabulary
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.mlp import positive_int_problems, raise_if_invalid


@dataclass
class GPTConfig:
    n_layer: int = 2  # number of Blocks; pipeline stages must divide it
    d_model: int = 64  # residual stream width
    n_head: int = 4  # must divide d_model; tensor parallelism must divide it
    d_mlp: int = 256  # 4 x d_model, as in GPT-2; tensor parallelism must divide it
    vocab_size: int = 256  # byte-sized: the token data set's default
    block_size: int = 64  # longest sequence: the length of the learned position table
    dropout: float = 0.0  # off by default: parity tests compare runs bit for bit

    def validate(self) -> None:
        problems = positive_int_problems(
            self, ("n_layer", "d_model", "n_head", "d_mlp", "vocab_size", "block_size")
        )
        if not problems and self.d_model % self.n_head:
            problems.append(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}) "
                "so every head gets the same width"
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout!r}")
        raise_if_invalid(self, problems)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.d_model
        # Output columns are [q | k | v], each D wide with the heads side by side in it.
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BTD, k_BTD, v_BTD = self.qkv(x_BTD).chunk(3, dim=-1)
        # The head count is read from the tensor, not the config: a qkv that produces only
        # some of the heads (a column-parallel shard) then works here unchanged.
        q_BHTK, k_BHTK, v_BHTK = (
            t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q_BTD, k_BTD, v_BTD)
        )
        y_BHTK = F.scaled_dot_product_attention(
            q_BHTK, k_BHTK, v_BHTK, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y_BTD = y_BHTK.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.proj(y_BTD))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_mlp)
        self.down = nn.Linear(config.d_mlp, config.d_model)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        h_BTM = F.gelu(self.up(x_BTD))
        return self.resid_drop(self.down(h_BTM))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = FeedForward(config)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.ln1(x_BTD))
        return x_BTD + self.mlp(self.ln2(x_BTD))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        # Each token's position, read as positions[:T]: a table, not arange(T), so that a rank
        # holding part of a sequence (context parallelism) can be given its tokens' positions.
        self.register_buffer("positions", torch.arange(config.block_size), persistent=False)
        self.emb_drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        # Not weight-tied to tok_emb (GPT-2 ties them): with separate weights the first
        # pipeline stage can hold the embedding and the last one the head, with no shared
        # parameter to keep in sync between them. No bias, as in GPT-2.
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's scheme, drawn from torch's global RNG in module order (callers seed it)."""
        std = 0.02
        # Each block adds two projections into the residual stream; scaling them keeps its
        # variance independent of depth.
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_resid = name.endswith("attn.proj") or name.endswith("mlp.down")
                nn.init.normal_(module.weight, mean=0.0, std=resid_std if is_resid else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        T = idx_BT.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x_BTD = self.emb_drop(self.tok_emb(idx_BT) + self.pos_emb(self.positions[:T]))
        for block in self.blocks:
            x_BTD = block(x_BTD)
        return self.head(self.ln_f(x_BTD))  # logits_BTV


def gpt_parameter_count(config: GPTConfig) -> int:
    """The number of parameters `GPT(config)` has, computed without building it."""
    config.validate()
    d, m, v = config.d_model, config.d_mlp, config.vocab_size
    layer_norm = 2 * d  # weight and bias
    attention = (d * 3 * d + 3 * d) + (d * d + d)  # qkv, proj
    mlp = (d * m + m) + (m * d + d)  # up, down
    block = 2 * layer_norm + attention + mlp
    embeddings = v * d + config.block_size * d  # tok_emb, pos_emb
    return embeddings + config.n_layer * block + layer_norm + d * v  # ... ln_f, head

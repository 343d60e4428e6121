"""A Llama-family decoder: RMSNorm, rotary position embeddings, SwiGLU and grouped-query
attention, pre-norm blocks, optional tied embeddings.

Like gpt.py it knows nothing of parallelism; every weight a parallelism splits is its own
named module, and `models/plans.py` says which:
`tok_emb`, `layers[i].{attn_norm, attn.{wq, wk, wv, wo}, mlp_norm, mlp.{w1, w2, w3}}`, `norm`,
`output`. The attention reads its head counts from `n_heads` / `n_kv_heads`, and names them in
`head_count_attrs`, so a plan that splits the heads over ranks knows what to divide.

Shape legend:
    B batch            T sequence position     D d_model        V vocabulary
    H query heads      G key/value heads (H / G queries share one)     K head dim (D / H)
    M d_mlp (SwiGLU's hidden width)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.mlp import positive_int_problems, raise_if_invalid


@dataclass
class LlamaConfig:
    n_layer: int = 2  # number of blocks
    d_model: int = 64  # residual stream width
    n_head: int = 4  # query heads; must divide d_model, and tensor parallelism must divide it
    n_kv_head: int = 2  # key/value heads (grouped-query attention); must divide n_head
    d_mlp: int = 192  # SwiGLU hidden width: ~ 8/3 x d_model, as in Llama (three matrices, not two)
    vocab_size: int = 256  # byte-sized: the token and text data sets' default
    block_size: int = 64  # longest sequence; rotary positions need no table, this bounds the data
    rope_theta: float = 10000.0  # rotary base, Llama 1/2's (Llama 3 uses 500000)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # output shares tok_emb's table (small Llamas do; pp must then be 1)

    def validate(self) -> None:
        problems = positive_int_problems(
            self, ("n_layer", "d_model", "n_head", "n_kv_head", "d_mlp", "vocab_size", "block_size")
        )
        if not problems:
            if self.d_model % self.n_head:
                problems.append(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
            elif self.head_dim % 2:
                problems.append(f"head dim d_model / n_head ({self.head_dim}) must be even for rotary embeddings")
            if self.n_head % self.n_kv_head:
                problems.append(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head}): "
                                "each key/value head serves the same number of query heads")
        if not isinstance(self.tie_embeddings, bool):
            problems.append(f"tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        raise_if_invalid(self, problems)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in fp32 whatever the input's dtype (as Llama does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x32 = x_BTD.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x_BTD) * self.weight


def rotate(x_BTNK: torch.Tensor, theta: float, positions_T: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding: each pair (x[i], x[i + K/2]) turned by position x frequency_i.

    The angles are computed from the tokens' positions (0..T-1 unless given), not looked up in a
    table of angles: nothing to keep in step between ranks.
    """
    T, K = x_BTNK.shape[1], x_BTNK.shape[-1]
    if positions_T is None:
        positions_T = torch.arange(T, device=x_BTNK.device)
    inv_freq_k = 1.0 / theta ** (torch.arange(0, K, 2, device=x_BTNK.device, dtype=torch.float32) / K)
    angles_Tk = torch.outer(positions_T.to(torch.float32), inv_freq_k)
    cos_T1K = torch.cat([angles_Tk.cos()] * 2, dim=-1).unsqueeze(1)
    sin_T1K = torch.cat([angles_Tk.sin()] * 2, dim=-1).unsqueeze(1)
    first, second = x_BTNK.float().chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x_BTNK.float() * cos_T1K + rotated * sin_T1K).type_as(x_BTNK)


class Attention(nn.Module):
    # The head counts a tensor-parallel plan divides by tp when it splits wq/wk/wv by heads.
    head_count_attrs = ("n_heads", "n_kv_heads")

    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, k = config.d_model, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_head, config.n_kv_head, k
        self.rope_theta = config.rope_theta
        self.wq = nn.Linear(d, config.n_head * k, bias=False)
        self.wk = nn.Linear(d, config.n_kv_head * k, bias=False)  # G < H heads: a smaller k/v
        self.wv = nn.Linear(d, config.n_kv_head * k, bias=False)
        self.wo = nn.Linear(config.n_head * k, d, bias=False)
        # Each token's position, read as positions[:T] (a rank holding part of a sequence under
        # context parallelism is given its tokens' positions here).
        self.register_buffer("positions", torch.arange(config.block_size), persistent=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        positions_T = self.positions[:T]
        q_BTHK = rotate(self.wq(x_BTD).view(B, T, self.n_heads, self.head_dim), self.rope_theta, positions_T)
        k_BTGK = rotate(self.wk(x_BTD).view(B, T, self.n_kv_heads, self.head_dim), self.rope_theta, positions_T)
        v_BTGK = self.wv(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        # enable_gqa: query head h reads key/value head h // (H/G), without copying K/V to H heads
        y_BHTK = F.scaled_dot_product_attention(q_BTHK.transpose(1, 2), k_BTGK.transpose(1, 2), v_BTGK.transpose(1, 2),
                                                is_causal=True, enable_gqa=True)
        return self.wo(y_BHTK.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.d_mlp, bias=False)  # gate
        self.w3 = nn.Linear(config.d_model, config.d_mlp, bias=False)  # up
        self.w2 = nn.Linear(config.d_mlp, config.d_model, bias=False)  # down

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BTD)) * self.w3(x_BTD))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(self._blocks(config))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.output = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_embeddings:
            self.output.weight = self.tok_emb.weight

    def _blocks(self, config) -> list[nn.Module]:
        """The decoder blocks, in order (a mixture of experts swaps some feed-forwards: moe_llama.py)."""
        return [LlamaBlock(config) for _ in range(config.n_layer)]

    def _init_weights(self) -> None:
        """Normal(0, 0.02), the residual projections scaled by depth (as gpt.py), drawn from
        torch's global RNG in module order (callers seed it)."""
        std = 0.02
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=resid_std if name.endswith(("wo", "w2")) else std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            else:
                self._init_other(module, std, resid_std)

    def _init_other(self, module: nn.Module, std: float, resid_std: float) -> None:
        """A module with weights of its own kind (none in a dense Llama)."""

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        if idx_BT.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length {idx_BT.shape[1]} exceeds block_size {self.config.block_size}")
        x_BTD = self.tok_emb(idx_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD)
        return self.output(self.norm(x_BTD))  # logits_BTV


def llama_parameter_count(config: LlamaConfig) -> int:
    """The number of parameters `Llama(config)` has, computed without building it."""
    config.validate()
    d, m, v, kv = config.d_model, config.d_mlp, config.vocab_size, config.n_kv_head * config.head_dim
    attention = 2 * d * d + 2 * d * kv  # wq, wo; wk, wv (smaller under grouped-query attention)
    block = 2 * d + attention + 3 * d * m  # two norms; SwiGLU's three matrices
    head = 0 if config.tie_embeddings else d * v
    return v * d + config.n_layer * block + d + head

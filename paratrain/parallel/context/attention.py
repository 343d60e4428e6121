"""`context_attention`: attention over a sequence split across the ranks of a context group, the
one call a model's attention makes in place of `F.scaled_dot_product_attention` under cp > 1."""

from __future__ import annotations

import math

import torch

from paratrain.parallel.context.allgather import AllGatherAttention
from paratrain.parallel.context.blocks import WaitClock
from paratrain.parallel.context.layout import chunks_per_rank
from paratrain.parallel.context.ring import RingAttention

METHODS = {"ring": RingAttention, "allgather": AllGatherAttention}


def context_attention(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, group, *,
                      causal: bool = True, layout: str = "zigzag", method: str = "ring",
                      scale: float | None = None, clock: WaitClock | None = None) -> torch.Tensor:
    """Attention of this rank's queries (B, H, S, D) over the whole sequence's keys and values,
    whose local parts (B, K, S, D) every rank of `group` holds in `layout` (layout.py). K may be
    fewer than H (grouped-query attention: only the K heads travel). `clock` adds up the seconds
    spent waiting on communication, forward and backward. -> this rank's output."""
    if method not in METHODS:
        raise ValueError(f"context attention: method must be one of {', '.join(METHODS)}, got {method!r}")
    chunks = chunks_per_rank(layout)
    if q_BHSD.dim() != 4 or k_BKSD.shape != v_BKSD.shape or k_BKSD.dim() != 4:
        raise ValueError(f"context attention: expected q (B, H, S, D) and k, v (B, K, S, D) alike, got "
                         f"{tuple(q_BHSD.shape)}, {tuple(k_BKSD.shape)}, {tuple(v_BKSD.shape)}")
    if q_BHSD.shape[2] != k_BKSD.shape[2] or q_BHSD.shape[2] % chunks:
        raise ValueError(f"context attention: queries and keys must hold the same local sequence, divisible "
                         f"by {chunks} for {layout}; got {q_BHSD.shape[2]} and {k_BKSD.shape[2]}")
    if scale is None:
        scale = 1.0 / math.sqrt(q_BHSD.shape[-1])
    return METHODS[method].apply(q_BHSD, k_BKSD, v_BKSD, group, layout, causal, scale, clock or WaitClock())

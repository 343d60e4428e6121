"""Which part of a sequence each context-parallel rank holds, and what attention work that gives it.

The sequence is cut into equal chunks. With `contiguous`, rank r of cp holds chunk r of cp. With
`zigzag` (the default), it is cut into 2·cp chunks and rank r holds chunks r and 2·cp−1−r:

    cp = 4, 8 chunks:   rank 0: 0 7   rank 1: 1 6   rank 2: 2 5   rank 3: 3 4

Under a causal mask a query attends to the keys at or before it. Contiguous sharding gives the
last rank the most work (its queries see the whole sequence) and the first the least; zigzag pairs
an early chunk with a late one, so every rank does the same work (`attention_work` counts it).

Chunk ids are global: chunk i covers positions [i·c, (i+1)·c) for chunk length c. A rank's local
sequence is its chunks concatenated in the order of `chunk_ids`.
"""

from __future__ import annotations

import torch

LAYOUTS = ("zigzag", "contiguous")


def chunks_per_rank(layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"context parallelism: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return 2 if layout == "zigzag" else 1


def chunk_ids(rank: int, cp: int, layout: str) -> tuple[int, ...]:
    """The global chunks rank `rank` holds, in local order."""
    if chunks_per_rank(layout) == 2:
        return (rank, 2 * cp - 1 - rank)
    return (rank,)


def length_problem(seq_len: int, cp: int, layout: str) -> str | None:
    """Why a sequence of `seq_len` tokens cannot be split over cp ranks, or None."""
    parts = cp * chunks_per_rank(layout)
    if cp > 1 and seq_len % parts:
        return (f"the sequence length {seq_len} must divide by {parts} "
                f"({'2·cp' if parts == 2 * cp else 'cp'} for {layout} context parallelism over cp {cp})")
    return None


def shard(x: torch.Tensor, dim: int, rank: int, cp: int, layout: str) -> torch.Tensor:
    """Rank `rank`'s part of `x` along `dim` (the sequence dimension)."""
    problem = length_problem(x.shape[dim], cp, layout)
    if problem:
        raise ValueError(problem)
    chunks = x.chunk(cp * chunks_per_rank(layout), dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, cp, layout)], dim)


def unshard(parts: list[torch.Tensor], dim: int, layout: str) -> torch.Tensor:
    """The whole sequence from every rank's part (parts[r] from rank r): `shard`'s inverse."""
    cp, per_rank = len(parts), chunks_per_rank(layout)
    chunks: list[torch.Tensor | None] = [None] * (cp * per_rank)
    for rank, part in enumerate(parts):
        for chunk_id, piece in zip(chunk_ids(rank, cp, layout), part.chunk(per_rank, dim)):
            chunks[chunk_id] = piece
    return torch.cat(chunks, dim)


def positions(rank: int, cp: int, seq_len: int, layout: str, device=None) -> torch.Tensor:
    """The global positions of rank `rank`'s tokens in a sequence of `seq_len` (what a model's
    position embedding or rotary angles need instead of arange of the local length)."""
    return shard(torch.arange(seq_len, device=device), 0, rank, cp, layout)


def attention_work(rank: int, cp: int, seq_len: int, layout: str, causal: bool = True) -> int:
    """Query-key pairs rank `rank` scores with an unmasked result (its share of attention's FLOPs)
    for one sequence and one head: a chunk pair below the diagonal counts c², one on it c(c+1)/2."""
    c = seq_len // (cp * chunks_per_rank(layout))
    total_chunks = cp * chunks_per_rank(layout)
    work = 0
    for q_chunk in chunk_ids(rank, cp, layout):
        for k_chunk in range(total_chunks):
            if not causal or k_chunk < q_chunk:
                work += c * c
            elif k_chunk == q_chunk:
                work += c * (c + 1) // 2
    return work

"""All-gather context attention: every rank gathers the whole sequence's keys and values once per
layer, scores its queries against them, and in backward reduce-scatters the keys' and values'
gradients home (the variant Megatron and torchtitan offer beside the ring).

One collective instead of cp−1 hops: it wins where a hop's latency is what costs (short local
sequences, many ranks), the ring where the gathered K/V would not fit or the hops hide behind
compute. The gathered K/V are not kept for backward (it gathers them again), so activation memory
is the ring's. Bytes per layer: forward one all-gather of 2·B·K·S·D elements per rank; backward
the same all-gather plus a reduce-scatter of cp·2·B·K·S·D accumulation-dtype elements.
"""

from __future__ import annotations

import torch

from paratrain.parallel.context.blocks import (
    Accumulator, Chunks, WaitClock, grouped, keep_for_backward, start_backward,
)
from paratrain.parallel.context.layout import chunk_ids


def _gather_blocks(group, k, v, clock: WaitClock) -> torch.Tensor:
    """-> (cp, 2, B, K, S, D): rank r's keys and values at [r]."""
    mine = torch.stack([k, v])
    everyone = torch.empty((group.size, *mine.shape), dtype=mine.dtype, device=mine.device)
    clock.call(group.all_gather, everyone, mine)
    return everyone


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout: str, causal: bool, scale: float, clock: WaitClock):
        cp, rank = group.size, group.rank
        mine = Chunks(chunk_ids(rank, cp, layout), q.shape[2])
        result = Accumulator(grouped(q, k.shape[1]), scale)
        for source, block in enumerate(_gather_blocks(group, k, v, clock)):
            result.add_block(mine, block[0], block[1], Chunks(chunk_ids(source, cp, layout), k.shape[2]), causal)
        return keep_for_backward(ctx, q, k, v, result, group=group, layout=layout, causal=causal, scale=scale,
                                 clock=clock)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, grads, call = start_backward(ctx, dout)
        group, layout, clock = call["group"], call["layout"], call["clock"]
        cp, rank = group.size, group.rank
        mine = Chunks(chunk_ids(rank, cp, layout), q.shape[2])
        dkv_everyone = torch.stack([
            grads.block(mine, block[0], block[1], Chunks(chunk_ids(source, cp, layout), k.shape[2]), call["causal"])
            for source, block in enumerate(_gather_blocks(group, k, v, clock))])
        dkv = torch.empty_like(dkv_everyone[0])
        clock.call(group.reduce_scatter, dkv, dkv_everyone)  # each block's dK/dV summed over every query's rank
        dq = grads.dq.view(q.shape).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None

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

from paratrain.parallel.context.blocks import Accumulator, Chunks, GradientAccumulator, WaitClock, grouped
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
        out = result.out.view(q.shape).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, result.lse)
        ctx.group, ctx.layout, ctx.causal, ctx.scale, ctx.clock = group, layout, causal, scale, clock
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, causal = ctx.group, ctx.layout, ctx.causal
        cp, rank, heads = group.size, group.rank, k.shape[1]
        grads = GradientAccumulator(grouped(q, heads), grouped(out, heads), grouped(dout.contiguous(), heads),
                                    lse, ctx.scale)
        mine = Chunks(chunk_ids(rank, cp, layout), q.shape[2])
        dkv_everyone = torch.stack([
            grads.block(mine, block[0], block[1], Chunks(chunk_ids(source, cp, layout), k.shape[2]), causal)
            for source, block in enumerate(_gather_blocks(group, k, v, ctx.clock))])
        dkv = torch.empty_like(dkv_everyone[0])
        ctx.clock.call(group.reduce_scatter, dkv, dkv_everyone)  # each block's dK/dV summed over every query's rank
        dq = grads.dq.view(q.shape).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None

"""Ring attention: each rank keeps its queries, and the key/value blocks go round the context
group, one hop per step, so that after cp steps every query has met every key.

Forward, cp steps. At step t rank r holds the block of rank r−t; it posts the send of that block
to r+1 and the receive of the next from r−1 *before* scoring its queries against it, so the
transfer runs behind the compute. Partial results merge by log-sum-exp (blocks.Accumulator).
Only q, k, v, out and the log-sum-exp are saved for backward.

Backward, the same ring again. K/V travel as in forward; the block's dK/dV travel one hop behind
them: rank r adds its share for the block it holds to what the block's previous holders summed
and passes it on, and after cp hops each block's dK/dV arrive home complete. dQ never leaves.

Bytes one rank sends per layer (B batch, K key/value heads, S local sequence, D head dim):
forward (cp−1)·2·B·K·S·D elements of the input's dtype; backward the same, plus cp·2·B·K·S·D
elements of dK/dV in the accumulation dtype (fp32 for bf16/fp16 inputs).
"""

from __future__ import annotations

import torch

from paratrain.parallel.context.blocks import (
    Accumulator, Chunks, WaitClock, grouped, keep_for_backward, start_backward,
)
from paratrain.parallel.context.layout import chunk_ids

# This group's point-to-point tags: a block and a block's gradient never share one.
KV_TAG, DKV_TAG = 11, 12


class Ring:
    """The context group seen as a ring: rank r sends to r+1 and receives from r−1."""

    def __init__(self, group):
        self.group = group
        self.next, self.previous = (group.rank + 1) % group.size, (group.rank - 1) % group.size

    def pass_on(self, send: torch.Tensor, receive_into: torch.Tensor, tag: int):
        """Start sending `send` on and receiving the previous rank's into `receive_into`;
        -> (the receive's handle, the send's handle)."""
        receiving = self.group.irecv(receive_into, self.previous, tag)
        return receiving, self.group.isend(send, self.next, tag)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout: str, causal: bool, scale: float, clock: WaitClock):
        cp, rank, ring = group.size, group.rank, Ring(group)
        mine = Chunks(chunk_ids(rank, cp, layout), q.shape[2])
        result = Accumulator(grouped(q, k.shape[1]), scale)
        block = torch.stack([k, v])
        spare = torch.empty_like(block)
        for step in range(cp):
            moving = ring.pass_on(block, spare, KV_TAG) if step < cp - 1 else ()
            theirs = Chunks(chunk_ids((rank - step) % cp, cp, layout), k.shape[2])
            result.add_block(mine, block[0], block[1], theirs, causal)
            clock.wait(*moving)
            block, spare = spare, block
        return keep_for_backward(ctx, q, k, v, result, group=group, layout=layout, causal=causal, scale=scale,
                                 clock=clock)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, grads, call = start_backward(ctx, dout)
        group, layout, causal, clock = call["group"], call["layout"], call["causal"], call["clock"]
        cp, rank, ring = group.size, group.rank, Ring(group)
        mine = Chunks(chunk_ids(rank, cp, layout), q.shape[2])
        block = torch.stack([k, v])
        spare = torch.empty_like(block)
        arriving = sending = incoming = None  # the dK/dV hop under way
        for step in range(cp):
            moving = ring.pass_on(block, spare, KV_TAG) if step < cp - 1 else ()
            theirs = Chunks(chunk_ids((rank - step) % cp, cp, layout), k.shape[2])
            dkv = grads.block(mine, block[0], block[1], theirs, causal)
            if arriving is not None:  # what the block's earlier holders summed
                clock.wait(arriving, sending)
                dkv += incoming
            if cp > 1:  # on to the next holder; the last hop takes each block's sum home
                incoming = torch.empty_like(dkv)
                arriving, sending = ring.pass_on(dkv, incoming, DKV_TAG)
            clock.wait(*moving)
            block, spare = spare, block
        if cp > 1:
            clock.wait(arriving, sending)
            dkv = incoming
        dq = grads.dq.view(q.shape).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None

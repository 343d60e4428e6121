"""Attention of a rank's query chunks against one block of key/value chunks, forward and backward,
with the partial results merged by their log-sum-exp: the arithmetic shared by ring and all-gather
context parallelism (ring.py, allgather.py), which differ only in how key/value blocks arrive.

Shapes (a legend, as in torchtitan): B batch, K key/value heads, G query heads per key/value head
(grouped-query attention; G = 1 without it), S a rank's local sequence, C one chunk of it, D the
head dimension. Queries are viewed as (B, K, G, S, D) so that one key/value head serves its G
query heads by broadcasting: K/V are never expanded to the query heads, and only K of them travel.

A chunk pair is scored whole (`FULL`: every key precedes every query), with a causal mask
(`DIAGONAL`: the same chunk), or not at all (its keys all follow its queries). The arithmetic is
done in `accumulation_dtype` (fp32 for bf16/fp16 inputs, fp64 stays fp64): the merge of partial
softmaxes subtracts nearly equal numbers, which 8 bits of mantissa cannot do.

Forward of one pair:   s = q kᵀ·scale (masked),  lse_b = logsumexp(s),  out_b = exp(s − lse_b) v
Merge:                 lse' = logaddexp(lse, lse_b),  out' = out·e^(lse−lse') + out_b·e^(lse_b−lse')
Backward of one pair, with the final lse and δ = rowsum(dout ∘ out):
                       p = exp(s − lse),  dv += pᵀ dout,  ds = p ∘ (dout vᵀ − δ),
                       dq += ds k·scale,  dk += dsᵀ q·scale
"""

from __future__ import annotations

import time

import torch

FULL, DIAGONAL = "full", "diagonal"

# PyTorch's fused CPU attention, which returns the log-sum-exp a merge needs and whose backward
# takes the final output and log-sum-exp (so it gives exactly one block's share of the gradients):
# tiled, it never holds a block's C x C scores, and at a small head dimension it runs an order of
# magnitude faster than the plain arithmetic below, which stays for other devices and dtypes.
_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def fused_kernel_for(x: torch.Tensor) -> bool:
    """Whether a block of `x`'s device and dtype runs through the fused CPU kernel (fp32, fp64:
    bf16 stays on the plain path, whose partial results are fp32 before they merge)."""
    return (_FUSED is not None and _FUSED_BACKWARD is not None and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.float64))


def _heads(x_BKGCD: torch.Tensor) -> torch.Tensor:
    B, K, G, C, D = x_BKGCD.shape
    return x_BKGCD.reshape(B, K * G, C, D)


def _expanded(x_BKCD: torch.Tensor, per_head: int) -> torch.Tensor:
    """K/V heads repeated for the fused kernel, which has no grouped-query form (transient)."""
    return x_BKCD.repeat_interleave(per_head, dim=1)


class WaitClock:
    """Seconds a rank spent waiting for communication it could not hide (`bench cp` reads it)."""

    def __init__(self):
        self.seconds = 0.0

    def wait(self, *handles) -> None:
        started = time.perf_counter()
        for handle in handles:
            handle.wait()
        self.seconds += time.perf_counter() - started

    def call(self, collective, *args) -> None:
        started = time.perf_counter()
        collective(*args)
        self.seconds += time.perf_counter() - started


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def pair_kind(q_chunk: int, k_chunk: int, causal: bool) -> str | None:
    """How query chunk `q_chunk` attends to key chunk `k_chunk` (global ids); None: not at all."""
    if not causal or k_chunk < q_chunk:
        return FULL
    return DIAGONAL if k_chunk == q_chunk else None


def grouped(q_BHSD: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, K, G, S, D): query head h uses key/value head h // G (Llama's order)."""
    B, H, S, D = q_BHSD.shape
    if H % kv_heads:
        raise ValueError(f"context attention: {H} query heads do not divide into {kv_heads} key/value heads")
    return q_BHSD.view(B, kv_heads, H // kv_heads, S, D)


def scored_pairs(q_chunks: "Chunks", k_chunks: "Chunks", causal: bool):
    """(kind, query slice, key slice) of every chunk pair scored at all."""
    for q_id, q_part in q_chunks:
        for k_id, k_part in k_chunks:
            kind = pair_kind(q_id, k_id, causal)
            if kind is not None:
                yield kind, q_part, k_part


class Chunks:
    """A local sequence seen as its chunks: slices along S with their global chunk ids."""

    def __init__(self, ids: tuple[int, ...], seq_len: int):
        self.ids, self.length = ids, seq_len // len(ids)

    def __iter__(self):
        for index, chunk_id in enumerate(self.ids):
            yield chunk_id, slice(index * self.length, (index + 1) * self.length)


def _scores(q_BKGCD, k_BKCD, kind: str, scale: float) -> torch.Tensor:
    s_BKGCC = torch.matmul(q_BKGCD, k_BKCD.unsqueeze(2).transpose(-1, -2)) * scale
    if kind == DIAGONAL:
        C = s_BKGCC.shape[-1]
        above = torch.ones(C, C, dtype=torch.bool, device=s_BKGCC.device).triu(1)
        s_BKGCC = s_BKGCC.masked_fill(above, float("-inf"))
    return s_BKGCC


def keep_for_backward(ctx, q, k, v, result: "Accumulator", **call) -> torch.Tensor:
    """End a forward: save only q, k, v, the output and the log-sum-exp, and how it was called
    (`call`: group, layout, causal, scale, clock); -> the output in q's dtype."""
    out = result.out.view(q.shape).to(q.dtype)
    ctx.save_for_backward(q, k, v, out, result.lse)
    ctx.call = call
    return out


def start_backward(ctx, dout) -> tuple:
    """-> (q, k, v, a GradientAccumulator for them, how forward was called)."""
    q, k, v, out, lse = ctx.saved_tensors
    heads = k.shape[1]
    grads = GradientAccumulator(grouped(q, heads), grouped(out, heads), grouped(dout.contiguous(), heads),
                                lse, ctx.call["scale"])
    return q, k, v, grads, ctx.call


class Accumulator:
    """A rank's running output and log-sum-exp, merged block by block (forward)."""

    def __init__(self, q_BKGSD: torch.Tensor, scale: float):
        dtype = accumulation_dtype(q_BKGSD.dtype)
        self.q = q_BKGSD.to(dtype)
        self.scale = scale
        self.out = torch.zeros_like(self.q)
        self.lse = torch.full(self.q.shape[:-1], float("-inf"), dtype=dtype, device=self.q.device)

    def add_block(self, q_chunks: Chunks, k_BKSD, v_BKSD, k_chunks: Chunks, causal: bool) -> None:
        k, v = k_BKSD.to(self.q.dtype), v_BKSD.to(self.q.dtype)
        attend = self._fused if fused_kernel_for(self.q) else self._plain
        for kind, q_part, k_part in scored_pairs(q_chunks, k_chunks, causal):
            out_b, lse_b = attend(self.q[..., q_part, :], k[..., k_part, :], v[..., k_part, :], kind)
            self._merge(q_part, out_b, lse_b)

    def _fused(self, q, k, v, kind: str):
        B, K, G, C, D = q.shape
        out_b, lse_b = _FUSED(_heads(q), _expanded(k, G), _expanded(v, G), 0.0, kind == DIAGONAL, scale=self.scale)
        return out_b.view(B, K, G, C, D), lse_b.view(B, K, G, C).to(self.lse.dtype)

    def _plain(self, q, k, v, kind: str):
        s = _scores(q, k, kind, self.scale)
        lse_b = torch.logsumexp(s, dim=-1)
        return torch.matmul(torch.exp(s - lse_b.unsqueeze(-1)), v.unsqueeze(2)), lse_b

    def _merge(self, part: slice, out_b, lse_b) -> None:
        lse = self.lse[..., part]
        merged = torch.logaddexp(lse, lse_b)
        self.out[..., part, :] = (self.out[..., part, :] * torch.exp(lse - merged).unsqueeze(-1)
                                  + out_b * torch.exp(lse_b - merged).unsqueeze(-1))
        self.lse[..., part] = merged


class GradientAccumulator:
    """A rank's dQ over every block, and one block's dK/dV at a time (backward)."""

    def __init__(self, q_BKGSD, out_BKGSD, dout_BKGSD, lse_BKGS, scale: float):
        dtype = lse_BKGS.dtype
        self.q, self.dout, self.lse, self.scale = q_BKGSD.to(dtype), dout_BKGSD.to(dtype), lse_BKGS, scale
        self.out = out_BKGSD.to(dtype)
        self.delta = (self.dout * self.out).sum(-1)  # δ: rowsum(dout ∘ out)
        self.dq = torch.zeros_like(self.q)

    def block(self, q_chunks: Chunks, k_BKSD, v_BKSD, k_chunks: Chunks, causal: bool) -> torch.Tensor:
        """dQ += this block's share; -> the block's (dK, dV) stacked as (2, B, K, S, D)."""
        k, v = k_BKSD.to(self.q.dtype), v_BKSD.to(self.q.dtype)
        dkv = torch.zeros((2, *k.shape), dtype=self.q.dtype, device=k.device)
        share = self._fused if fused_kernel_for(self.q) else self._plain
        for kind, q_part, k_part in scored_pairs(q_chunks, k_chunks, causal):
            dq, dk, dv = share(q_part, k[..., k_part, :], v[..., k_part, :], kind)
            self.dq[..., q_part, :] += dq
            dkv[0][..., k_part, :] += dk
            dkv[1][..., k_part, :] += dv
        return dkv

    def _fused(self, part: slice, k, v, kind: str):
        """Given the final output and log-sum-exp, the fused backward gives exactly this block's share."""
        q = self.q[..., part, :]
        B, K, G, C, D = q.shape
        dq, dk, dv = _FUSED_BACKWARD(_heads(self.dout[..., part, :]), _heads(q), _expanded(k, G), _expanded(v, G),
                                     _heads(self.out[..., part, :]), self.lse[..., part].reshape(B, K * G, C), 0.0,
                                     kind == DIAGONAL, scale=self.scale)
        return dq.view(B, K, G, C, D), dk.view(B, K, G, C, D).sum(2), dv.view(B, K, G, C, D).sum(2)

    def _plain(self, part: slice, k, v, kind: str):
        q, dout = self.q[..., part, :], self.dout[..., part, :]
        p = torch.exp(_scores(q, k, kind, self.scale) - self.lse[..., part].unsqueeze(-1))
        dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)
        ds = p * (torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2)) - self.delta[..., part].unsqueeze(-1))
        dq = torch.matmul(ds, k.unsqueeze(2)) * self.scale
        return dq, torch.matmul(ds.transpose(-1, -2), q).sum(2) * self.scale, dv

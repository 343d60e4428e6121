"""The routed SwiGLU experts' grouped matrix multiplies on the CPU: forward and backward written
out, the experts cut into chunks that run on threads at once.

torch's CPU `grouped_mm` is one matrix multiply per expert, one after another, each spread over
the intra-op threads. At 64 experts of about 128 rows each those multiplies are too small to
share: the threads mostly wait for each other. A grouped GEMM kernel on a GPU instead spreads
every group's tiles over all its cores in one launch. Here, likewise, the experts are cut into
contiguous chunks of about equal rows, one per intra-op thread, and each chunk's grouped_mm
calls run on a thread of their own, single-threaded (torch.set_num_threads(1) for the call, the
count restored after: a chunk's multiplies spread over every thread as well would put threads
times threads of them on the cores; so only the main thread cuts chunks). Forward and backward at moe-small's widths (d_model 128,
d_expert 96, 8192 rows, 2 threads): 64 experts 17 ms against grouped_mm's 27 (a per-expert loop:
35); 128 experts 26 against 44. Where the busiest expert holds more than half a chunk's share of
the rows (8 experts, say) the chunks would come out uneven and its multiplies are large enough
to share: one chunk, as grouped_mm alone. On CUDA and under autocast the layer keeps grouped_mm's
own autograd (moe_experts.py).

The backward is written out so that it runs chunk by chunk on the threads as well. Per expert,
over its rows:
    g = x W1,  u = x W3,  h = silu(g) * u,  y = h W2
    dh = dy W2^T,  dW2 = h^T dy,  dg = silu'(g) * (dh * u),  du = dh * silu(g)
    dx = dg W1^T + du W3^T,  dW1 = x^T dg,  dW3 = x^T du
These are the multiplies autograd makes for the same forward; a multiply on one thread may round
its last bit differently from the same one on two, so the results agree with grouped_mm's
autograd to rounding (a test holds them to 1e-6). x, g and u are kept for the backward; silu(g)
and h are made again there (autograd's graph would keep both).

Shape legend: S rows (token, expert pairs) sorted by expert, D d_model, F d_expert.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def chunks_of(counts_e: list[int], threads: int) -> list[tuple[int, int]]:
    """Contiguous ranges [first, end) of the experts: one per thread, each closing where the rows
    so far pass its share of all rows; one range of them all where there is one thread, or where
    the busiest expert holds more than half a chunk's share (the chunks would be uneven)."""
    parts, total = min(threads, len(counts_e)), sum(counts_e)
    if parts < 2 or total == 0 or max(counts_e) * 2 * parts > total:
        return [(0, len(counts_e))]
    ranges, first, seen = [], 0, 0
    for expert, count in enumerate(counts_e):
        seen += count
        if len(ranges) < parts - 1 and expert + 1 < len(counts_e) and seen * parts >= total * (len(ranges) + 1):
            ranges.append((first, expert + 1))
            first = expert + 1
    ranges.append((first, len(counts_e)))
    return ranges


@functools.lru_cache(maxsize=None)
def _threads(pid: int, count: int) -> ThreadPoolExecutor:
    """The threads that run the chunks, per process: keyed by the pid, since a forked child
    holds its parent's pool without the pool's threads."""
    return ThreadPoolExecutor(count, thread_name_prefix="experts")


@contextmanager
def _one_thread_each():
    """Each chunk's multiplies on its own thread alone, for the call; the count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _chunking() -> bool:
    """Whether this call may cut the experts into chunks on threads: from the main thread only.
    The intra-op thread count is the process's, and ranks run as threads of one process
    (launcher threads) would each set it and restore what another had set: it could stay at 1."""
    return threading.current_thread() is threading.main_thread()


def _on_threads(work, pieces: list) -> list:
    """work(piece) for every piece, on threads at once where there are several (in turn on this
    thread if it is not the main one). No grad mode: GroupedSwiGLU is the one node autograd sees."""
    def run(piece):
        with torch.no_grad():
            return work(piece)
    if len(pieces) == 1 or not _chunking():
        return [run(piece) for piece in pieces]
    with _one_thread_each():
        return list(_threads(os.getpid(), len(pieces)).map(run, pieces))


class _Chunk:
    """A chunk's rows [low, high) of the sorted rows, its experts [first, end), their offsets."""

    def __init__(self, starts: list[int], first: int, end: int, counts_e: list[int]):
        self.rows, self.experts = slice(starts[first], starts[end]), slice(first, end)
        self.offsets_e = torch.tensor(counts_e[first:end], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _forward(x_SD, w1, w3, w2, offsets_e):
    gate_SF = F.grouped_mm(x_SD, w1, offs=offsets_e)
    up_SF = F.grouped_mm(x_SD, w3, offs=offsets_e)
    return gate_SF, up_SF, F.grouped_mm(F.silu(gate_SF) * up_SF, w2, offs=offsets_e)


def _backward(x_SD, w1, w3, w2, offsets_e, gate_SF, up_SF, grad_SD):
    silu_SF = F.silu(gate_SF)
    grad_hidden_SF = F.grouped_mm(grad_SD, w2.transpose(-2, -1), offs=offsets_e)
    grad_w2 = F.grouped_mm((silu_SF * up_SF).t(), grad_SD, offs=offsets_e)
    grad_gate_SF = torch.ops.aten.silu_backward(grad_hidden_SF * up_SF, gate_SF)
    grad_up_SF = grad_hidden_SF * silu_SF
    grad_x_SD = (F.grouped_mm(grad_gate_SF, w1.transpose(-2, -1), offs=offsets_e)
                 + F.grouped_mm(grad_up_SF, w3.transpose(-2, -1), offs=offsets_e))
    grad_w1 = F.grouped_mm(x_SD.t(), grad_gate_SF, offs=offsets_e)
    grad_w3 = F.grouped_mm(x_SD.t(), grad_up_SF, offs=offsets_e)
    return grad_x_SD, grad_w1, grad_w3, grad_w2


class GroupedSwiGLU(torch.autograd.Function):
    """y = (silu(x W1) * (x W3)) W2 on each expert's rows, the experts in chunks on threads."""

    @staticmethod
    def forward(ctx, x_SD, w1, w3, w2, counts_e: list[int]):
        starts = [0]
        for count in counts_e:
            starts.append(starts[-1] + count)
        threads = torch.get_num_threads() if _chunking() else 1
        chunks = [_Chunk(starts, first, end, counts_e) for first, end in chunks_of(counts_e, threads)]
        made = _on_threads(lambda c: _forward(x_SD[c.rows], w1[c.experts], w3[c.experts], w2[c.experts], c.offsets_e),
                           chunks)
        ctx.chunks, ctx.kept = chunks, [(gate_SF, up_SF) for gate_SF, up_SF, _ in made]
        ctx.save_for_backward(x_SD, w1, w3, w2)
        return torch.cat([out_SD for _, _, out_SD in made]) if len(made) > 1 else made[0][2]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_SD):
        x_SD, w1, w3, w2 = ctx.saved_tensors
        grad_SD = grad_SD.contiguous()  # a gradient from a sum is broadcast (stride 0)

        def chunk_backward(piece):
            chunk, (gate_SF, up_SF) = piece
            experts = chunk.experts
            return _backward(x_SD[chunk.rows], w1[experts], w3[experts], w2[experts], chunk.offsets_e,
                             gate_SF, up_SF, grad_SD[chunk.rows])

        grads = _on_threads(chunk_backward, list(zip(ctx.chunks, ctx.kept)))
        ctx.kept = None
        if len(grads) == 1:
            return (*grads[0], None)
        return (*(torch.cat(parts) for parts in zip(*grads)), None)


def grouped_swiglu(x_SD: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   counts_e: list[int]) -> torch.Tensor:
    """The experts' SwiGLU on their rows (`counts_e` each, in expert order): GroupedSwiGLU."""
    return GroupedSwiGLU.apply(x_SD, w1, w3, w2, counts_e)

"""A short local profile of compute: what one rank of this machine does per op class.

On one thread (as each rank of `paratrain train --launcher processes` gets), in CPU time (so a
shared machine's other programs do not count), for the GPT block shapes in SHAPES:

1. matmul rate: the block's weight matmuls, forward and both backward products, alone;
2. attention rate: scaled_dot_product_attention forward and backward, alone;
3. element-wise bandwidth and per-operator cost: what whole blocks (forward + backward) take
   beyond 1 and 2, fitted by non-negative least squares (relative error) to the cost model's
   own counts of element-wise bytes and operators.

The counts are the cost model's (cost_model.layer_passes with one op class priced at a time),
so what is fitted is exactly what the planner multiplies.

Also measured: the best rate of one large matmul (the "peak" MFU is relative to on a CPU, which
has no data-sheet figure here) and the memory copy bandwidth (plan/membw.py).
"""

from __future__ import annotations

import itertools
import statistics
import time

import numpy as np
import torch

from paratrain.plan.membw import copy_bandwidth_gbps
from paratrain.models import GPTConfig
from paratrain.models.gpt import Block
from paratrain.plan.activations import Software
from paratrain.plan.cost_model import layer_passes
from paratrain.plan.hardware import Compute, HardwareProfile, Link
from paratrain.plan.memory import Layout
from paratrain.plan.shapes import GPTShape

# (micro-batch, sequence, hidden): tokens up to 2048 so the whole profile takes seconds.
SHAPES = [(b, s, h) for h in (64, 128, 256) for s in (64, 128) for b in (1, 4, 16) if b * s <= 2048]
_HUGE = 1e30


def _probe(which: str, software: Software) -> HardwareProfile:
    """A profile where only `which` costs anything, one second per unit."""
    rates = {"matmul": _HUGE, "attention": _HUGE, "memory": _HUGE, "ops": 0.0}
    rates[which] = 1.0 if which != "ops" else 1e6
    compute = Compute(peak_tflops=1e-12, matmul_efficiency=rates["matmul"], attention_efficiency=rates["attention"],
                      memory_gbps=1e-9, memory_efficiency=rates["memory"], op_overhead_us=rates["ops"])
    free = Link(_HUGE, 1.0, 0.0)
    return HardwareProfile("probe", "", 1, 1, 0, compute, free, free, software)


def layer_features(shape: GPTShape, micro_batch: int, software: Software) -> list[float]:
    """Matmul FLOPs, attention FLOPs, element-wise bytes and operators of one layer's forward
    and backward, as the cost model counts them."""
    layout = Layout(micro_batch=micro_batch)
    return [sum(p.compute for p in layer_passes(shape, layout, _probe(which, software)).values())
            for which in ("matmul", "attention", "memory", "ops")]


def time_block(micro_batch: int, seq: int, hidden: int) -> float:
    """CPU seconds of forward + backward through one fp32 block on this thread."""
    config = GPTConfig(n_layer=1, d_model=hidden, n_head=max(hidden // 64, 1), d_mlp=4 * hidden,
                       vocab_size=256, block_size=seq)
    torch.manual_seed(0)
    block = Block(config)
    x = torch.randn(micro_batch, seq, hidden, requires_grad=True)
    grad = torch.randn(micro_batch, seq, hidden)
    return _median_cpu_seconds(lambda: block(x).backward(grad))


def nonnegative_least_squares(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |a x - y| with x >= 0, by trying every set of free coefficients (there are few)."""
    best, best_error = np.zeros(a.shape[1]), float(np.sum(y**2))
    for k in range(1, a.shape[1] + 1):
        for free in itertools.combinations(range(a.shape[1]), k):
            x_free, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
            if np.all(x_free >= 0):
                x = np.zeros(a.shape[1])
                x[list(free)] = x_free
                error = float(np.sum((a @ x - y) ** 2))
                if error < best_error:
                    best, best_error = x, error
    return best


def matmul_peak_tflops(n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e12


def _timed(fn) -> float:
    start = time.thread_time()  # CPU time: a shared machine's other programs do not count
    fn()
    return time.thread_time() - start


def _median_cpu_seconds(fn, repeats: int = 5) -> float:
    for _ in range(2):  # the first calls touch memory and warm caches
        fn()
    return statistics.median(_timed(fn) for _ in range(repeats))


def time_matmuls(micro_batch: int, seq: int, hidden: int) -> float:
    """CPU seconds of one block's weight matmuls: forward, input gradient, weight gradient."""
    tokens = micro_batch * seq
    total = 0.0
    for k, n in ((hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden)):
        x, w, dy = torch.randn(tokens, k), torch.randn(k, n), torch.randn(tokens, n)
        total += _median_cpu_seconds(lambda: (x @ w, dy @ w.T, x.T @ dy))
    return total


def time_attention(micro_batch: int, seq: int, hidden: int) -> float:
    """CPU seconds of causal attention's forward and backward (SDPA, as the GPT calls it)."""
    heads = max(hidden // 64, 1)
    q, k, v = (torch.randn(micro_batch, heads, seq, hidden // heads, requires_grad=True) for _ in range(3))
    grad = torch.randn(micro_batch, heads, seq, hidden // heads)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return _median_cpu_seconds(lambda: sdpa(q, k, v, is_causal=True).backward(grad))


def profile_compute(software: Software, threads: int = 1) -> tuple[Compute, dict]:
    """The fitted Compute section and how well it fits whole blocks (relative error per shape)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows, blocks, matmuls, attention = [], [], [], []
        for b, s, h in SHAPES:
            shape = GPTShape(layers=1, hidden=h, heads=max(h // 64, 1), seq=s, vocab=256)
            rows.append(layer_features(shape, b, software))
            blocks.append(time_block(b, s, h))
            matmuls.append(time_matmuls(b, s, h))
            attention.append(time_attention(b, s, h))
        peak = matmul_peak_tflops()
        copy = copy_bandwidth_gbps("cpu")
    finally:
        torch.set_num_threads(previous)
    features, seconds = np.array(rows), np.array(blocks)
    per_matmul = sum(matmuls) / features[:, 0].sum()
    per_attention = sum(attention) / features[:, 1].sum()
    rest = seconds - features[:, 0] * per_matmul - features[:, 1] * per_attention
    per_byte, per_op = nonnegative_least_squares(features[:, 2:] / seconds[:, None], rest / seconds)
    fitted = features @ np.array([per_matmul, per_attention, per_byte, per_op])
    compute = Compute(
        peak_tflops=round(float(peak), 6),
        matmul_efficiency=round(1.0 / float(per_matmul) / (peak * 1e12), 4),
        attention_efficiency=round(1.0 / float(per_attention) / (peak * 1e12), 4),
        memory_gbps=round(float(copy), 3),
        memory_efficiency=round(1.0 / max(float(per_byte), 1e-30) / (copy * 1e9), 4),
        op_overhead_us=round(float(per_op) * 1e6, 3),
    )
    errors = {f"b{b} s{s} h{h}": float(f / t - 1) for (b, s, h), f, t in zip(SHAPES, fitted, seconds)}
    return compute, {"shapes": len(SHAPES), "threads": threads, "relative_errors": errors}


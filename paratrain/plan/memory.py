"""Memory per GPU of a GPT on a tp x pp x dp layout: weights, gradients, optimizer state,
activations, and a backward workspace.

Model state follows Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", Section 3.1): mixed-precision Adam keeps 2 bytes of bf16 weights,
2 of bf16 gradients and K = 12 of optimizer state (fp32 master weights, momentum, variance) per
parameter; ZeRO stage 1 divides the 12 by the data-parallel size. paratrain trains in fp32: 4 + 4
bytes, Adam's 8, and a 4-byte step counter per parameter tensor; its ZeRO-1
(parallel/data/zero.py) keeps on each rank its shard of the parameters and of their gradient
(4 + 4 bytes) beside that shard's Adam state; its ZeRO-2 the same without the whole gradients;
its ZeRO-3 / FSDP (parallel/data/fsdp.py) only the shards: 4 + 4 + 8 bytes per parameter over dp,
and a step counter per unit (taken as one per parameter tensor here: a few bytes more). FSDP's
gathered units are transient (one or two units at a time) and not in these figures.

Activations are activations.py's per-layer bytes, summed over what a pipeline rank holds at
worst, found by walking the rank's list of the actual schedule (and, when the schedule splits
the backward, what B keeps for W).

Under expert parallelism (ep > 1) a mixture of experts' routed experts are held whole, E/ep per
layer on each rank (moe.py), outside every ZeRO stage (paratrain's strategies leave them to
expert/gradients.py): their weights, gradients and Adam state are counted apart from the rest's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from paratrain.parallel.pipeline.schedules import build_schedule
from paratrain.parallel.pipeline.split import balanced_partition
from paratrain.plan.activations import Software, head_activation_bytes, layer_activation_bytes, weight_grad_bytes
from paratrain.plan.moe import expert_parameters, moe_mlp_width
from paratrain.plan.layout import Layout
from paratrain.plan.shapes import GPTShape

GIB = float(1 << 30)

# Layouts of one search share schedules; the zero-bubble ones take a while to build.
cached_schedule = lru_cache(maxsize=1024)(build_schedule)


@dataclass
class Memory:
    weights: float
    grads: float
    optimizer: float
    activations: float
    workspace: float
    stage: int = 0  # the pipeline rank these figures are for (the one that needs most)
    params: int = 0  # parameters held by that rank
    per_stage: list[float] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.workspace

    def as_gib(self) -> dict[str, float]:
        names = ("weights", "grads", "optimizer", "activations", "workspace", "total")
        return {name: getattr(self, name) / GIB for name in names}


def layer_parameters(shape: GPTShape, tp: int) -> list[tuple[float, int]]:
    """(parameters on one tp rank, parameter tensors) of each pipeline layer: the embeddings,
    every block, then the final norm with the head. Matrices are split over tp as Megatron and
    paratrain split them; biases of row-parallel layers, norms and positions are replicated.
    An MoE model's MLPs stay whole, and its routed experts are moe.expert_parameters', not these."""
    h, m, v = shape.hidden, shape.mlp, shape.vocab
    if shape.experts:  # router and shared experts (3 tensors if any) in an MoE layer
        blocks = [(shape.attention_weights() / tp + 2 * h + h * shape.experts
                   + shape.shared_experts * shape.expert_weights(), 7 + 3 * (shape.shared_experts > 0))
                  if shape.is_moe(i) else (shape.attention_weights() / tp + shape.mlp_weights() + 2 * h, 9)
                  for i in range(shape.layers)]
        return [(v * h / tp, 1)] + blocks + [(h * v / tp + h, 2)]
    if shape.gated:  # a Llama: no biases, no positions, one-vector RMSNorms
        block = (shape.attention_weights() + shape.mlp_weights()) / tp + 2 * h
        return [(v * h / tp, 1)] + [(block, 9)] * shape.layers + [(h * v / tp + h, 2)]
    sharded = (3 * h * h + 3 * h) + h * h + (h * m + m) + m * h
    block = sharded / tp + 2 * h + 4 * h
    return [(v * h / tp + shape.seq * h, 2)] + [(block, 12)] * shape.layers + [(h * v / tp + 2 * h, 3)]


def held_parameters(shape: GPTShape, layout: Layout) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """(what the data-parallel strategy holds, routed experts held apart), each as
    layer_parameters lists them. At ep 1 the experts are ordinary parameters (ZeRO shards them, the
    strategy reduces them); at ep > 1 each rank holds E/ep of them whole."""
    params, routed = layer_parameters(shape, layout.tp), expert_parameters(shape, layout.ep)
    if layout.ep == 1:
        return [(p + r, n + m) for (p, n), (r, m) in zip(params, routed)], [(0, 0)] * len(params)
    return params, routed


def chunk_layers(shape: GPTShape, chunks: int, software: Software) -> list[range]:
    """Which pipeline layers (0 = embeddings, 1..l = blocks, l+1 = head) each chunk holds."""
    if chunks == 1:
        return [range(0, shape.layers + 2)]
    if software.even_layers:
        if shape.layers % chunks:
            raise ValueError(f"{shape.layers} layers do not split evenly into {chunks} pipeline chunks")
        per = shape.layers // chunks
        counts = [per + 1] + [per] * (chunks - 2) + [per + 1]
    else:
        blocks = [shape.attention_weights() + shape.mlp_weights(shape.is_moe(i)) for i in range(shape.layers)]
        counts = balanced_partition([1] + blocks + [shape.hidden * shape.vocab], chunks)
    starts = [sum(counts[:c]) for c in range(chunks)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def state_bytes(params: float, tensors: int, dp: int, zero: int, precision: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes for `params` parameters in `tensors` tensors."""
    shard = math.ceil(params / dp)
    if precision == "fp32":
        if zero == 3:
            return 4 * shard, 4 * shard, 8 * shard + 4 * tensors
        if zero:
            return 4 * params, 4 * params * (zero == 1), (4 + 4 + 8) * shard + 4
        return 4 * params, 4 * params, 8 * params + 4 * tensors
    return (2 * params / (dp if zero == 3 else 1), 2 * params / (dp if zero >= 2 else 1),
            12 * params / (dp if zero else 1))


def peak_activation_bytes(order, per_chunk: dict[int, float], kept_for_w: dict[int, float] | None = None) -> float:
    """The most bytes a rank holds while it runs `order`: each F adds its chunk's activations
    and B frees them; with a split backward, B keeps `kept_for_w` (inputs and output gradients
    of the linear layers) instead, and W frees that."""
    held = peak = 0.0
    for action in order:
        if action.op == "F":
            held += per_chunk[action.stage]
        elif action.op == "B":
            held += (kept_for_w[action.stage] if kept_for_w else 0.0) - per_chunk[action.stage]
        elif action.op == "W":
            held -= kept_for_w[action.stage]
        peak = max(peak, held)
    return peak


def _per_chunk(shape: GPTShape, chunks: list[range], per_layer: dict[bool, float], head: float) -> dict[int, float]:
    """Bytes per chunk from `per_layer`'s bytes of a dense layer (False) and an MoE layer (True)."""
    return {c: sum(per_layer[shape.is_moe(i - 1)] for i in layers if 1 <= i <= shape.layers)
            + (head if shape.layers + 1 in layers else 0) for c, layers in enumerate(chunks)}


def context_local(shape: GPTShape, software: Software, cp: int) -> tuple[GPTShape, Software]:
    """What one context-parallel rank's activations look like: 1/cp of the sequence, and attention
    that keeps Q, K, V, its output and the log-sum-exp (ring attention keeps nothing s x s)."""
    if cp == 1:
        return shape, software
    return replace(shape, seq=shape.seq // cp), replace(software, flash_attention=True)


def _widest_mlp(shape: GPTShape, tp: int) -> float:
    """The MLP's hidden width on one tp rank, widest over the layer kinds (an MoE model's whole)."""
    if not shape.experts:
        return shape.mlp / tp
    return max(shape.mlp, moe_mlp_width(shape))


def memory_per_gpu(shape: GPTShape, layout: Layout, global_batch: int, software: Software) -> Memory:
    """The memory of the pipeline rank that needs most."""
    t, b = layout.tp, layout.micro_batch
    params, routed = held_parameters(shape, layout)
    shape, software = context_local(shape, software, layout.cp)  # parameters above are the whole model's
    per_layer = {moe: layer_activation_bytes(shape, b, software, t, layout.sequence_parallel, layout.recompute, moe)
                 for moe in (False, True)}
    head = head_activation_bytes(shape, b, software, t, layout.sequence_parallel)
    if layout.pp > 1:
        schedule = cached_schedule(layout.schedule, layout.pp, layout.microbatches(global_batch),
                                  layout.virtual_stages)
        chunks = chunk_layers(shape, schedule.num_chunks, software)
        orders, owner = schedule.ranks, schedule.chunks_of
    else:
        chunks, orders, owner = chunk_layers(shape, 1, software), None, lambda r: [0]
    per_chunk = _per_chunk(shape, chunks, per_layer, head)
    kept_for_w = None
    if orders and schedule.split_backward:
        if layout.recompute == "none" and not layout.sequence_parallel:
            layer, head_kept = weight_grad_bytes(shape, b, software, t)  # an MoE layer's taken as a dense one's
            kept_for_w = _per_chunk(shape, chunks, {False: layer, True: layer}, head_kept)
        else:  # paratrain cannot split these: W walks the whole graph again, kept until then
            kept_for_w = per_chunk
    logits = 4 * shape.seq * b * shape.vocab / t
    workspace_layer = 2 * software.activation_bytes * shape.seq * b * _widest_mlp(shape, t)
    stages = []
    for rank in range(layout.pp):
        mine = [i for c in owner(rank) for i in chunks[c]]
        count = sum(params[i][0] for i in mine)
        tensors = sum(params[i][1] for i in mine)
        weights, grads, optimizer = state_bytes(count, tensors, layout.replicas, layout.zero, software.precision)
        experts = sum(routed[i][0] for i in mine)  # whole on each rank: no ZeRO shards them
        held = state_bytes(experts, sum(routed[i][1] for i in mine), 1, 0, software.precision)
        weights, grads, optimizer, count = weights + held[0], grads + held[1], optimizer + held[2], count + experts
        activations = (peak_activation_bytes(orders[rank], per_chunk, kept_for_w) if orders
                       else per_chunk[0])
        holds_head = shape.layers + 1 in mine
        workspace = 2 * logits if holds_head else workspace_layer  # gradients alive mid-backward
        stages.append(Memory(weights, grads, optimizer, activations, workspace, rank, round(count)))
    worst = max(stages, key=lambda m: m.total)
    worst.per_stage = [m.total for m in stages]
    return worst

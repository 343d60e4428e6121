"""One layout of one GPT on one hardware profile: step time, its breakdown, memory, MFU.

Time of one microbatch through one layer on one tensor-parallel rank is a roofline sum of op
classes: weight matmuls (flops.py) at the profile's matmul rate, the attention core at its
attention rate, element-wise traffic (norms, GELU, residual adds, the loss) at its memory
bandwidth, and a fixed cost per operator. Backward is twice the forward's matmuls; recomputation
adds the forward it repeats. Tensor-parallel collectives (two per layer each way, Megatron's
f and g; sequence parallelism swaps each all-reduce for an all-gather plus a reduce-scatter of
the same bytes) and the pipeline's sends are charged to the action that waits for them.

Every collective is priced on the group the Mesh's grid makes (comm_model.py: which nodes its
ranks sit on); the flat algorithm is charged and the two-level one kept beside it (`collectives`).

These per-chunk costs go into the schedule simulator (parallel/pipeline/simulate.py) on the
actual schedule's lists, so the bubble is the schedule's own, with real costs. The data-parallel
gradient reduction, less what backward hides, and the optimizer step follow the pipeline.
MFU counts model FLOPs (no recomputation; Korthikanti et al. 2022, Section 6), HFU all done.

A mixture of experts (moe.py) runs its MoE layers' MLPs on the active weights, whole on each tp
rank (paratrain's MoE plan splits attention only, so one exchange each way per layer), and adds
expert parallelism's all-to-alls to each MoE layer's forward and backward (`ep_comm`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from paratrain.parallel.pipeline.simulate import simulate
from paratrain.plan.comm_model import Priced, collective_seconds, group_placement, price
from paratrain.plan.flops import (
    attention_matmul_flops,
    flash_backward_flops,
    layer_attention_flops,
    logit_flops,
    mlp_matmul_flops,
    step_flops,
)
from paratrain.plan.hardware import HardwareProfile
from paratrain.plan.memory import (
    Layout, Memory, cached_schedule, chunk_layers, context_local, held_parameters, memory_per_gpu,
)
from paratrain.plan.moe import MOE_OPS, ep_all_to_all, ep_exchange, expert_reduce, moe_mlp_width
from paratrain.plan.shapes import GPTShape

LAYER_OPS = 30   # operators per layer, forward and backward: ~10 kernels forward, ~20 backward
HEAD_OPS = 12    # final norm, logits, loss; forward and backward
ADAM_BYTES = 28  # read weight, gradient, two moments; write weight and two moments (4 bytes each)


@dataclass(frozen=True)
class Pass:
    """Seconds of one chunk action, by what they are spent on."""

    compute: float = 0.0
    tp_comm: float = 0.0
    pp_comm: float = 0.0
    cp_comm: float = 0.0  # what of the context ring (or all-gather) attention's compute does not hide
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (nothing hides them)

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.pp_comm + self.cp_comm + self.ep_comm

    def __add__(self, other: Pass) -> Pass:
        return Pass(self.compute + other.compute, self.tp_comm + other.tp_comm, self.pp_comm + other.pp_comm,
                    self.cp_comm + other.cp_comm, self.ep_comm + other.ep_comm)

    def scaled(self, compute: float) -> Pass:
        """The same pass with its compute `compute` times as long."""
        return Pass(self.compute * compute, self.tp_comm, self.pp_comm, self.cp_comm, self.ep_comm)

    def times(self, n: int) -> Pass:
        """n of this pass, one after another."""
        return Pass(self.compute * n, self.tp_comm * n, self.pp_comm * n, self.cp_comm * n, self.ep_comm * n)


@dataclass
class Prediction:
    layout: Layout
    step_s: float
    memory: Memory
    fits: bool
    bubble: float
    mfu: float
    hfu: float
    breakdown: dict[str, float]  # seconds: compute, tp_comm, pp_comm, cp_comm, ep_comm, bubble, dp_comm, optimizer
    collectives: dict[str, Priced] = field(default_factory=dict)  # one call per group: tp, cp, dp, ep, edp

    def to_json(self) -> dict:
        return {"layout": asdict(self.layout), "step_s": self.step_s, "memory_gib": self.memory.as_gib(),
                "fits": self.fits, "bubble": self.bubble, "mfu": self.mfu, "hfu": self.hfu,
                "breakdown": self.breakdown, "across_nodes": self.across_nodes()}

    def across_nodes(self) -> dict[str, dict]:
        """The collectives whose groups span nodes: one call each, flat and in two levels."""
        return {axis: {"op": c.op, "nodes": c.where.nodes, "per_node": c.where.per_node, "algorithm": c.algorithm,
                       "flat_s": c.flat_s, "hier_s": c.hier_s}
                for axis, c in self.collectives.items() if c.where.spans}


def _elementwise_bytes(shape: GPTShape, b: int, profile: HardwareProfile, tp: int, sp: bool, mlp_width: float) -> float:
    """Forward element-wise traffic of one layer: two norms and two residual adds (read 2, write 1)
    on the replicated width, GELU on the MLP width of one tp rank, the softmax on eager attention."""
    software = profile.software
    e, tokens = software.activation_bytes, shape.seq * b
    replicated = (2 * 2 + 2 * 3 + (5 if software.dropout else 0)) * shape.hidden
    split = 0 if software.flash_attention else (7 if software.dropout else 4) * shape.heads * shape.seq
    return e * tokens * (replicated / (tp if sp else 1) + split / tp + 2 * mlp_width)


def _compute_seconds(matmul: float, attention: float, elementwise: float, ops: float, profile) -> float:
    c = profile.compute
    return (matmul / c.matmul_flops + attention / c.attention_flops + elementwise / c.memory_bytes_per_s
            + ops * c.op_overhead_us * 1e-6)


def tp_exchange(shape: GPTShape, layout: Layout, profile: HardwareProfile) -> Priced:
    """One of Megatron's conjugate tensor-parallel exchanges of an activation: an all-reduce, or
    under sequence parallelism an all-gather and a reduce-scatter (Korthikanti et al. 2022,
    Section 4.2.2: the same bytes)."""
    activation = shape.seq * layout.micro_batch * shape.hidden * profile.software.activation_bytes
    where = group_placement(profile, layout, "tp")
    if layout.sequence_parallel:
        return price(profile, "all_gather", activation, where) + price(profile, "reduce_scatter", activation, where)
    return price(profile, "all_reduce", activation, where)


def _context_block(shape: GPTShape, layout: Layout, profile: HardwareProfile) -> float:
    """Bytes of one rank's K/V block (kv heads only, this tp rank's)."""
    kv_width = shape.hidden * shape.kv_heads // shape.heads // layout.tp
    return 2 * layout.micro_batch * (shape.seq // layout.cp) * kv_width * profile.software.activation_bytes


def ring_exposed(shape: GPTShape, layout: Layout, profile: HardwareProfile, attention_s: tuple[float, float]
                 ) -> tuple[float, float]:
    """Seconds of one layer's context ring that attention's compute does not hide, forward and
    backward (parallel/context/ring.py): each of the cp steps scores one block while the next
    block's K/V travel; backward sends K/V again and the dK/dV (fp32) one hop behind.
    `attention_s`: the layer's attention compute, forward and backward."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    block, across = _context_block(shape, layout, profile), group_placement(profile, layout, "cp").spans
    hop = collective_seconds(profile, "p2p", block, 2, across)
    gradient_hop = collective_seconds(profile, "p2p", block * 4 / profile.software.activation_bytes, 2, across)
    forward_step, backward_step = attention_s[0] / cp, attention_s[1] / cp
    return ((cp - 1) * max(0.0, hop - forward_step),
            (cp - 1) * max(0.0, hop + gradient_hop - backward_step) + max(0.0, gradient_hop - backward_step))


def context_gathers(shape: GPTShape, layout: Layout, profile: HardwareProfile) -> tuple[Priced, Priced]:
    """One layer's context all-gather (parallel/context/allgather.py), forward and backward:
    forward gathers every rank's K/V; backward gathers them again and reduce-scatters the fp32 dK/dV."""
    cp, where = layout.cp, group_placement(profile, layout, "cp")
    block = _context_block(shape, layout, profile)
    gather = price(profile, "all_gather", cp * block, where)
    return gather, gather + price(profile, "reduce_scatter", cp * block * 4 / profile.software.activation_bytes, where)


def allgather_exposed(shape: GPTShape, layout: Layout, profile: HardwareProfile) -> tuple[float, float]:
    """Seconds of one layer's context all-gather, forward and backward: nothing computes while it
    runs, so all of it is exposed."""
    if layout.cp == 1:
        return 0.0, 0.0
    forward, backward = context_gathers(shape, layout, profile)
    return forward.seconds, backward.seconds


@dataclass(frozen=True)
class ContextChoice:
    """Ring against all-gather for one layout: each one's exposed seconds per layer (forward,
    backward), attention's compute they race, and the method `auto` picks (the smaller exposed
    total; the ring on a tie, since it never holds every rank's K/V at once)."""

    ring: tuple[float, float]
    allgather: tuple[float, float]
    attention: tuple[float, float]

    @property
    def method(self) -> str:
        return "allgather" if sum(self.allgather) < sum(self.ring) else "ring"

    @property
    def ring_hides(self) -> bool:
        return sum(self.ring) == 0.0

    def describe(self, used: str, profile_name: str) -> list[str]:
        """Two lines: each method's exposed time beside attention's, and what runs."""
        ms = lambda pair: f"{pair[0] * 1e3:.3g} / {pair[1] * 1e3:.3g} ms"  # noqa: E731
        picked = f"auto picks {self.method}" + ("" if used in ("auto", self.method) else f", this run uses {used}")
        return [f"context parallel, per layer and microbatch on {profile_name} (forward / backward): attention "
                f"{ms(self.attention)}; exposed: ring {ms(self.ring)}, all-gather {ms(self.allgather)}",
                f"  the ring {'hides behind attention' if self.ring_hides else 'does not hide behind attention'}; "
                f"{picked}"]


def context_choice(shape: GPTShape, layout: Layout, profile: HardwareProfile) -> ContextChoice:
    """The ring and the all-gather priced for one layer of one microbatch on this layout."""
    t, b, cp = layout.tp, layout.micro_batch, layout.cp
    software = context_local(shape, profile.software, cp)[1]
    att = layer_attention_flops(shape, b) / t / cp
    flash = flash_backward_flops(shape, b) / shape.layers / t / cp if software.flash_attention else 0.0
    attention = (_compute_seconds(0, att, 0, 0, profile), _compute_seconds(0, 2 * att + flash, 0, 0, profile))
    return ContextChoice(ring_exposed(shape, layout, profile, attention), allgather_exposed(shape, layout, profile),
                         attention)


def layer_passes(shape: GPTShape, layout: Layout, profile: HardwareProfile, moe: bool = False) -> dict[str, Pass]:
    """Forward, input-gradient and weight-gradient passes of one layer (an MoE layer: moe) for one
    microbatch (on one context-parallel rank: 1/cp of the tokens, and 1/cp of attention's
    query-key pairs, zigzag). An MoE model's MLPs are whole on every tp rank."""
    t, b, cp = layout.tp, layout.micro_batch, layout.cp
    local, software = context_local(shape, profile.software, cp)
    mlp_tp = 1 if shape.experts else t
    mm = attention_matmul_flops(local, b) / t + mlp_matmul_flops(local, b, moe) / mlp_tp
    att = layer_attention_flops(shape, b) / t / cp
    mlp_width = moe_mlp_width(shape) if moe else shape.mlp / mlp_tp
    ew = _elementwise_bytes(local, b, replace(profile, software=software), t, layout.sequence_parallel, mlp_width)
    flash = flash_backward_flops(shape, b) / shape.layers / t / cp if software.flash_attention else 0.0
    ops = (LAYER_OPS + (MOE_OPS if moe else 0)) / 3
    forward = _compute_seconds(mm, att, ew, ops, profile)
    input_grad = _compute_seconds(mm, 2 * att + flash, 2 * ew, ops, profile)
    weight_grad = _compute_seconds(mm, 0, 0, ops, profile)
    if layout.recompute == "full":
        input_grad += forward
    elif layout.recompute == "selective":
        input_grad += _compute_seconds(0, att, 0, 0, profile)
    two = (1 if shape.experts else 2) * tp_exchange(local, layout, profile).seconds
    recomputed = two if layout.recompute == "full" else 0.0
    choice = context_choice(shape, layout, profile)
    ring_forward, ring_backward = choice.allgather if layout.cp_method == "allgather" else choice.ring
    ep_forward, ep_backward = ep_exchange(shape, layout, profile) if moe else (0.0, 0.0)
    if layout.recompute == "full":
        ring_backward += ring_forward
        ep_backward += ep_forward
    return {"F": Pass(forward, two, cp_comm=ring_forward, ep_comm=ep_forward),
            "B": Pass(input_grad, two + recomputed, cp_comm=ring_backward, ep_comm=ep_backward), "W": Pass(weight_grad)}


def head_passes(shape: GPTShape, layout: Layout, profile: HardwareProfile) -> dict[str, Pass]:
    """The final norm, logits and the fp32 loss over this rank's share of the vocabulary."""
    t, b = layout.tp, layout.micro_batch
    shape = context_local(shape, profile.software, layout.cp)[0]
    tokens = shape.seq * b
    logits = logit_flops(shape, b) / t
    norm = profile.software.activation_bytes * tokens * 2 * shape.hidden
    loss = 4 * tokens * shape.vocab / t  # one fp32 pass over the logits
    comm = tp_exchange(shape, layout, profile).seconds
    return {"F": Pass(_compute_seconds(logits, 0, norm + 3 * loss, HEAD_OPS / 3, profile)),
            "B": Pass(_compute_seconds(logits, 0, 2 * norm + 4 * loss, HEAD_OPS / 3, profile), comm),
            "W": Pass(_compute_seconds(logits, 0, 0, HEAD_OPS / 3, profile))}


def chunk_passes(shape: GPTShape, layout: Layout, profile: HardwareProfile, chunks: list[range]) -> list[dict[str, Pass]]:
    kinds = {moe: layer_passes(shape, layout, profile, moe) for moe in ((False, True) if shape.experts else (False,))}
    head = head_passes(shape, layout, profile)
    blocks_of = shape.is_moe  # of the whole shape: the local one below has the same layers
    t, b = layout.tp, layout.micro_batch
    shape = context_local(shape, profile.software, layout.cp)[0]  # what a stage sends: its tokens
    activation = shape.seq * b * shape.hidden * profile.software.activation_bytes
    embed_comm = tp_exchange(shape, layout, profile).seconds
    across = group_placement(profile, layout, "pp").spans
    if profile.software.p2p_scatter_gather or layout.sequence_parallel:
        send = (collective_seconds(profile, "p2p", activation / t, 2, across)
                + (0.0 if layout.sequence_parallel else collective_seconds(profile, "all_gather", activation, t, False)))
    else:
        send = collective_seconds(profile, "p2p", activation, 2, across)
    passes = []
    for index, layers in enumerate(chunks):
        total = {op: sum((kinds[blocks_of(i - 1)][op] for i in layers if 1 <= i <= shape.layers), Pass())
                 for op in ("F", "B", "W")}
        if 0 in layers:
            total["F"] += Pass(_compute_seconds(0, 0, 2 * activation, 2, profile), embed_comm)
        if shape.layers + 1 in layers:
            total = {op: total[op] + head[op] for op in total}
        if layout.pp > 1:
            if index < len(chunks) - 1:
                total["F"] += Pass(pp_comm=send)
            if index > 0:
                total["B"] += Pass(pp_comm=send)
        passes.append(total)
    return passes


def _cpu_slowdown(profile: HardwareProfile, layout: Layout, schedule) -> float:
    """Ranks beyond a CPU host's cores share them (one thread per rank, as the launcher sets);
    a pipeline rank idle in its bubble leaves its core to the others."""
    if not profile.cores:
        return 1.0
    busy_share = 1 - simulate(schedule).bubble if schedule else 1.0
    return max(1.0, layout.gpus * busy_share / profile.cores)


def resolve_context_method(shape: GPTShape, layout: Layout, profile: HardwareProfile) -> Layout:
    """The layout with cp_method "auto" replaced by what context_choice picks."""
    if layout.cp_method != "auto":
        return layout
    return replace(layout, cp_method=context_choice(shape, layout, profile).method if layout.cp > 1 else "ring")


def predict(shape: GPTShape, layout: Layout, profile: HardwareProfile, global_batch: int) -> Prediction:
    layout = resolve_context_method(shape, layout, profile)
    m = layout.microbatches(global_batch)
    software = profile.software
    schedule = cached_schedule(layout.schedule, layout.pp, m, layout.virtual_stages) if layout.pp > 1 else None
    chunks = chunk_layers(shape, schedule.num_chunks if schedule else 1, software)
    passes = chunk_passes(shape, layout, profile, chunks)
    if schedule is None or not schedule.split_backward:
        for chunk in passes:
            chunk["B"], chunk["W"] = chunk["B"] + chunk["W"], Pass()
    slowdown = _cpu_slowdown(profile, layout, schedule)
    passes = [{op: p.scaled(slowdown) for op, p in chunk.items()} for chunk in passes]
    if schedule:
        ops = ("F", "B", "W") if schedule.split_backward else ("F", "B")
        timeline = simulate(schedule, {op: [chunk[op].total for chunk in passes] for op in ops})
        makespan, bubble = timeline.makespan, timeline.bubble
        rank_chunks = [schedule.chunks_of(r) for r in range(layout.pp)]
    else:
        makespan = m * sum(p.total for p in passes[0].values())
        bubble, rank_chunks = 0.0, [[0]]
    # The busiest rank's time, split by kind; what is left of the makespan is its bubble.
    busy = [sum((passes[c][op] for c in mine for op in passes[c]), Pass()) for mine in rank_chunks]
    busiest = max(busy, key=lambda p: p.total)
    per_microbatch = busiest.times(m)
    last_backward = max(sum(passes[c]["B"].total + passes[c]["W"].total for c in mine) for mine in rank_chunks)
    dp_s, optimizer_s, reductions = _data_parallel_and_optimizer(shape, layout, profile, rank_chunks, chunks,
                                                                 last_backward)
    step = makespan + dp_s + optimizer_s
    memory = memory_per_gpu(shape, layout, global_batch, software)
    peak = profile.compute.peak_tflops * 1e12 * layout.gpus * step
    breakdown = {"compute": per_microbatch.compute, "tp_comm": per_microbatch.tp_comm,
                 "pp_comm": per_microbatch.pp_comm, "cp_comm": per_microbatch.cp_comm,
                 "ep_comm": per_microbatch.ep_comm,
                 "bubble": max(0.0, makespan - per_microbatch.total),
                 "dp_comm": dp_s, "optimizer": optimizer_s}
    hardware_flops = step_flops(shape, global_batch, layout.recompute)
    if software.flash_attention:
        hardware_flops += flash_backward_flops(shape, global_batch)
    return Prediction(layout, step, memory, memory.total <= profile.usable_bytes, bubble,
                      step_flops(shape, global_batch) / peak, hardware_flops / peak, breakdown,
                      _collectives(shape, layout, profile, reductions))


def _collectives(shape: GPTShape, layout: Layout, profile: HardwareProfile, reductions: dict[str, Priced]
                 ) -> dict[str, Priced]:
    """One call of each group's collective, as priced: a tp exchange, the backward's context
    all-gather and reduce-scatter (cp all-gather only), a dispatch all-to-all, and the step's
    gradient reductions; groups of one rank left out."""
    found = {"tp": tp_exchange(context_local(shape, profile.software, layout.cp)[0], layout, profile)}
    if layout.cp_method == "allgather":
        found["cp"] = context_gathers(shape, layout, profile)[1]
    found["dp"] = reductions["dp"]
    if shape.experts:
        found.update(ep=ep_all_to_all(shape, layout, profile), edp=reductions["edp"])
    return {axis: c for axis, c in found.items() if c.where.size > 1}


def _data_parallel_and_optimizer(shape, layout, profile, rank_chunks, chunks, last_backward
                                 ) -> tuple[float, float, dict[str, Priced]]:
    """Exposed gradient reduction (ZeRO-1/2: not hidden; DDP and ZeRO-3: hidden as the profile's
    dp_overlap says) and the Adam step, for the pipeline rank holding most parameters; and the
    reductions themselves (dp, and edp for routed experts: all-reduced over the edp ranks holding
    them after the last backward, moe.py, not hidden)."""
    params, routed = held_parameters(shape, layout)
    held = max(sum(params[i][0] for c in mine for i in chunks[c]) for mine in rank_chunks)
    tensors = max(sum(params[i][1] + routed[i][1] for c in mine for i in chunks[c]) for mine in rank_chunks)
    experts = max(sum(routed[i][0] for c in mine for i in chunks[c]) for mine in rank_chunks)
    grad_size = 4 if profile.software.precision == "fp32" else 2
    reductions = {"dp": gradient_reduction(layout, profile, grad_size * held),
                  "edp": expert_reduce(shape, layout, profile, experts)}
    reduce = reductions["dp"].seconds
    hidden = 0.0 if layout.zero in (1, 2) else min(reduce, profile.dp_overlap * last_backward)
    dp_s = reduce - hidden + reductions["edp"].seconds
    updated = held / (layout.replicas if layout.zero else 1) + experts
    zero_grad = grad_size * (held + experts)
    optimizer_s = ((ADAM_BYTES * updated + zero_grad) / profile.compute.memory_bytes_per_s
                   + 2 * tensors * profile.compute.op_overhead_us * 1e-6)
    return dp_s, optimizer_s, reductions


def gradient_reduction(layout: Layout, profile: HardwareProfile, grad_bytes: float) -> Priced:
    """One step's gradient traffic over the dp x cp ranks holding the same parameters: DDP's
    all-reduce; ZeRO-1/2 a reduce-scatter then an all-gather; ZeRO-3 per unit an all-gather
    before forward and backward and a reduce-scatter after."""
    where = group_placement(profile, layout, "dp_cp")
    reduce_scatter = price(profile, "reduce_scatter", grad_bytes, where)
    all_gather = price(profile, "all_gather", grad_bytes, where)
    if layout.zero == 3:
        return reduce_scatter + all_gather + all_gather
    if layout.zero:
        return reduce_scatter + all_gather
    return price(profile, "all_reduce", grad_bytes, where)

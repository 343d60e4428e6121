"""A mixture of experts on a layout: the experts each rank holds, and expert parallelism's traffic.

Expert parallelism (`ep`, parallel/expert/) takes its ep ranks from the data axis (dp x cp): rank
r of a group holds L = E/ep of each MoE layer's routed experts, whole (tensor parallelism does not
split them), and a token goes once to each rank holding any of its k chosen experts, not once
per expert (dispatch.py). Under uniform routing a rank holds none of a token's experts with
probability C(E−L, k) / C(E, k), so a token is sent

    rows per token = ep · (1 − C(E−L, k) / C(E, k))        (8 experts, top-2, ep 2: 11/7, not 2)

times. Each MoE layer's forward is a dispatch all-to-all and a combine all-to-all of rows x h
activations per rank, its backward the same two again (the rows' gradients, both ways), priced
with comm_model's all-to-all; nothing computes meanwhile, so all of it is exposed (`ep_comm`).
The experts' gradients are reduced over the edp = dp·cp/ep ranks holding the same experts, in
one all-reduce after the last backward (expert/gradients.py); no ZeRO stage shards them.
"""

from __future__ import annotations

from math import comb

from paratrain.plan.comm_model import Priced, group_placement, price
from paratrain.plan.hardware import HardwareProfile
from paratrain.plan.layout import Layout
from paratrain.plan.shapes import GPTShape


EXPERT_TENSORS = 3  # w1, w3, w2, each stacked over a rank's experts
MOE_OPS = 30  # operators an MoE layer adds, forward and backward: router, top-k, sort, gathers, index_add, grouped mms


def rows_per_token(experts: int, top_k: int, ep: int) -> float:
    """Rows a token is sent as on average, uniform routing: one per rank holding any of its
    top_k experts (E/ep consecutive experts per rank)."""
    local = experts // ep
    return ep * (1 - comb(experts - local, top_k) / comb(experts, top_k))


def expert_parameters(shape: GPTShape, ep: int) -> list[tuple[float, int]]:
    """(routed-expert parameters one ep rank holds, their tensors) of each pipeline layer, as
    memory.layer_parameters lists them: the embeddings, every block, the head."""
    per_block = [(shape.experts // ep * shape.expert_weights(), EXPERT_TENSORS) if shape.is_moe(i) else (0, 0)
                 for i in range(shape.layers)]
    return [(0, 0)] + per_block + [(0, 0)]


def moe_mlp_width(shape: GPTShape) -> int:
    """Hidden width a token passes through in an MoE layer: its top_k and the shared experts'."""
    return (shape.top_k + shape.shared_experts) * shape.expert_mlp


def dispatch_bytes(shape: GPTShape, layout: Layout, profile: HardwareProfile) -> float:
    """Bytes one rank sends in one dispatch (or combine) of one microbatch: rows x h, for its
    1/cp of each sequence."""
    rows = shape.seq // layout.cp * layout.micro_batch * rows_per_token(shape.experts, shape.top_k, layout.ep)
    return rows * shape.hidden * profile.software.activation_bytes


def ep_all_to_all(shape: GPTShape, layout: Layout, profile: HardwareProfile) -> Priced:
    """One dispatch (or combine) all-to-all of one microbatch over an ep group."""
    return price(profile, "all_to_all", dispatch_bytes(shape, layout, profile), group_placement(profile, layout, "ep"))


def ep_exchange(shape: GPTShape, layout: Layout, profile: HardwareProfile) -> tuple[float, float]:
    """Seconds of one MoE layer's all-to-alls for one microbatch, forward and backward: dispatch
    and combine each way."""
    if layout.ep == 1:
        return 0.0, 0.0
    both = 2 * ep_all_to_all(shape, layout, profile).seconds
    return both, both


def expert_reduce(shape: GPTShape, layout: Layout, profile: HardwareProfile, held: float) -> Priced:
    """The all-reduce of `held` routed-expert parameters' gradients over the edp ranks, after
    the step's last backward (expert/gradients.py): nothing hides it."""
    grad_bytes = (4 if profile.software.precision == "fp32" else 2) * held
    return price(profile, "all_reduce", grad_bytes, group_placement(profile, layout, "edp"))


def describe_experts(shape: GPTShape) -> str:
    """One line: the experts, and total against active parameters."""
    from paratrain.models import format_count

    shared = f" + {shape.shared_experts} shared" if shape.shared_experts else ""
    return (f"mixture of experts: {shape.experts} experts of width {shape.expert_mlp}, top-{shape.top_k}{shared}, "
            f"in {shape.moe_layers} of {shape.layers} layers; {format_count(shape.parameters())} parameters, "
            f"{format_count(shape.parameters(active=True))} active per token")


def describe_dispatch(shape: GPTShape, layout: Layout, ep_comm_s: float, where: str) -> str:
    """One line: rows per token against once per chosen expert, and the all-to-all time."""
    rows = rows_per_token(shape.experts, shape.top_k, layout.ep)
    saving = 1 - rows / shape.top_k
    local, edp = shape.experts // layout.ep, layout.replicas // layout.ep
    return (f"expert parallel ep {layout.ep} ({local} expert{'s' if local > 1 else ''} per rank and layer, "
            f"gradients reduced over {edp} rank{'s' if edp > 1 else ''}): {rows:.3g} rows per token dispatched "
            f"of {shape.top_k} chosen "
            f"({saving:.0%} fewer than once per expert); all-to-all {ep_comm_s * 1e3:.3g} ms per step on {where}")

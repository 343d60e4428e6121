"""How long a collective or a point-to-point message takes on a profile's links (alpha-beta).

Ring algorithms, as NCCL's and paratrain's ring: an all-reduce of S bytes over n ranks sends
2(n-1)/n * S per rank in 2(n-1) steps; all-gather and reduce-scatter half of that (the book
chapter's `bytes x 2(n-1)/n / bandwidth`, and nccl-tests' busbw factors). An all-to-all of S
bytes per rank (its send buffer, its own share included) sends (n-1)/n * S to the n-1 others,
priced as n-1 messages one after another: (n-1) alpha + (n-1)/n * S / bandwidth, an
approximation (a real one overlaps the messages, and across nodes meets the fabric's bisection).
A group on one node uses the intra-node link; a group that spans nodes is held to the
inter-node link of each device.
A fitted entry in the profile (measured `op/world_size`) replaces the formula.

Ranks are placed as paratrain's Mesh places them: tp innermost, then pp, then dp.
"""

from __future__ import annotations

from paratrain.plan.hardware import HardwareProfile

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def collective_seconds(profile: HardwareProfile, op: str, nbytes: float, n: int, spans_nodes: bool) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    fitted = profile.fitted(op, n)
    if fitted is not None:
        return fitted.seconds(nbytes)
    link = profile.inter_node if spans_nodes else profile.intra_node
    alpha, bandwidth = link.latency_us * 1e-6, link.bytes_per_s
    if op == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bandwidth
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * alpha + (n - 1) / n * nbytes / bandwidth
    if op == "p2p":
        return alpha + nbytes / bandwidth
    raise ValueError(f"unknown op {op!r}; valid: {', '.join(OPS)}")


def spans_nodes(profile: HardwareProfile, tp: int, pp: int, dp: int) -> dict[str, bool]:
    """Whether each axis' groups (or, for pp, some neighbouring stages) sit on different nodes."""
    node = profile.devices_per_node
    return {"tp": tp > node, "pp": tp * pp > node, "dp": tp * pp * dp > node}

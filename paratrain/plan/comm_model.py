"""How long a collective or a point-to-point message takes on a profile's links (alpha-beta), and
which algorithm a group that spans nodes runs.

On one link of latency α and bandwidth B per device and direction, n ranks, S bytes (an
all-gather's output, a reduce-scatter's input, an all-to-all's send buffer), as NCCL's and
paratrain's rings and the book chapter's `bytes x 2(n-1)/n / bandwidth` (nccl-tests' busbw factors):

    all-reduce(n, S)      = 2(n-1) α + 2(n-1)/n · S/B   a reduce-scatter, then an all-gather
    reduce-scatter(n, S)  = (n-1) α + (n-1)/n · S/B     each rank sends n-1 of its n shares
    all-gather(n, S)      = (n-1) α + (n-1)/n · S/B     the same steps, the other way
    all-to-all(n, S)      = (n-1) α + (n-1)/n · S/B     n-1 messages one after another: an
                                                        approximation (a real one overlaps them)
    p2p(S)                = α + S/B

A group on one node uses the intra-node link (α_i, B_i). A group of n = h·L ranks on h nodes, L on
each (where they sit is the Mesh's own grid, paratrain/mesh.py: tp innermost, then cp, pp, dp),
has two algorithms:

- flat: the formula above on the inter-node link (α_e, B_e) of each device, as if every hop
  crossed nodes (a ring through the nodes; the all-to-all's messages);
- hier, two levels (NCCL's topology-aware rings, one per NIC, come close to it; paratrain's
  `algo="hier"` is it), with RS/AR/AG the formulas above on the link named:

      all-reduce     = RS_i(L, S) + AR_e(h, S/L) + AG_i(L, S)
      reduce-scatter = RS_i(L, S) + RS_e(h, S/L)
      all-gather     = AG_e(h, S/L) + AG_i(L, S)

  After a reduce-scatter inside the node each rank holds the node's sum of 1/L of the buffer; the
  h ranks of each local index (one per node) all-reduce that S/L, the L local indices at once,
  each on its own link; an all-gather inside the node rebuilds S. A reduce-scatter stops after
  the second step (each rank then holds S/(hL) = S/n, summed over all); an all-gather runs the
  steps in reverse. Across nodes each rank then sends 2(h-1)/h · S/L where the flat ring charges
  2(n-1)/n · S to the slow link; on equal links the two move the same, (L-1)/L + (h-1)/(hL) =
  (n-1)/n, hier in fewer steps. With one rank per node hier is the flat ring: not priced apart.
  The all-to-all stays flat: a two-level one sends the same (h-1)/h · S per rank across nodes as
  the flat one, so it would save latency only, at the price of an extra pass inside the node.

`Priced` holds both; its algorithm is the cheaper, and what the step time charges is the flat
one (`Priced.seconds` says why).
A fitted entry in the profile (measured `op/world_size`) replaces a formula.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from paratrain.mesh import GROUPS, axis_partition, expert_partitions, mesh_grid
from paratrain.plan.hardware import HardwareProfile
from paratrain.plan.layout import Layout

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
# Each two-level collective as its steps, in order: the op and whether it runs across nodes (on
# S/L bytes among h ranks) or inside a node (on S bytes among L ranks).
HIER_STEPS = {
    "all_reduce": (("reduce_scatter", False), ("all_reduce", True), ("all_gather", False)),
    "reduce_scatter": (("reduce_scatter", False), ("reduce_scatter", True)),
    "all_gather": (("all_gather", True), ("all_gather", False)),
}


def collective_seconds(profile: HardwareProfile, op: str, nbytes: float, n: int, spans_nodes: bool) -> float:
    """One collective on one link: the inter-node one for a group that spans nodes (flat)."""
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


def hierarchical_seconds(profile: HardwareProfile, op: str, nbytes: float, nodes: int, per_node: int) -> float:
    """`op` in two levels over `nodes` nodes of `per_node` ranks (HIER_STEPS)."""
    return sum(collective_seconds(profile, step, nbytes / per_node, nodes, True) if across
               else collective_seconds(profile, step, nbytes, per_node, False)
               for step, across in HIER_STEPS[op])


@dataclass(frozen=True)
class Placement:
    """Where one group's ranks sit: `size` ranks on `nodes` nodes, `per_node` on each (0 where the
    nodes hold different numbers of them: no two-level algorithm then)."""

    size: int
    nodes: int
    per_node: int

    @property
    def spans(self) -> bool:
        return self.nodes > 1


def group_placement(profile: HardwareProfile, layout: Layout, group: str) -> Placement:
    """The placement of a layout's groups along `group`: an axis of paratrain.mesh.GROUPS
    ("tp", "cp", "pp", "dp", "dp_cp") or "ep" / "edp" (the experts' groups)."""
    return _placement(profile.devices_per_node, layout.dp, layout.pp, layout.cp, layout.tp, layout.ep, group)


@lru_cache(maxsize=4096)
def _placement(devices_per_node: int, dp: int, pp: int, cp: int, tp: int, ep: int, group: str) -> Placement:
    grid = mesh_grid(dp, pp, tp, cp)
    groups = expert_partitions(grid, ep)[group] if group in ("ep", "edp") else axis_partition(grid, GROUPS[group])
    # The groups run at once and the step waits for the slowest: the one on most nodes.
    counts = max((Counter(rank // devices_per_node for rank in ranks) for ranks in groups), key=len)
    even = len(set(counts.values())) == 1
    return Placement(sum(counts.values()), len(counts), next(iter(counts.values())) if even else 0)


@dataclass(frozen=True)
class Priced:
    """One collective (or several on the same group, one after another) priced both ways: the flat
    algorithm's seconds and the two-level one's (None where it does not apply: a group on one node,
    one rank per node, nodes holding different numbers of ranks, an all-to-all)."""

    op: str
    where: Placement
    flat_s: float
    hier_s: float | None = None

    @property
    def algorithm(self) -> str:
        """The cheaper; flat on a tie."""
        return "hier" if self.hier_s is not None and self.hier_s < self.flat_s else "flat"

    @property
    def seconds(self) -> float:
        """What the step time counts: the flat algorithm's. The two-level one is what NCCL comes
        close to and what paratrain runs across hosts, but charging it makes the predictions of
        the data-parallel rows it changes (Narayanan et al. 2021, Table 1: tp 1, 2, 4 over 32 to
        128 A100s) worse, not better: the flat ring's overcharge presumably offsets the compute
        model's optimism on small matmuls (docs/planning.md, "Collectives across nodes")."""
        return self.flat_s

    def __add__(self, other: Priced) -> Priced:
        if other.where != self.where:
            raise ValueError("only collectives on the same group add up")
        ops = self.op.split(" + ")
        op = " + ".join(ops + ([other.op] if other.op not in ops else []))
        hier = None if self.hier_s is None or other.hier_s is None else self.hier_s + other.hier_s
        return Priced(op, self.where, self.flat_s + other.flat_s, hier)

    def describe(self, axis: str) -> str:
        """One line: where the group sits, the algorithm it uses and its seconds, then the other's
        (or why there is no other)."""
        where, ms = self.where, lambda seconds: f"{seconds * 1e3:.3g} ms"
        ranks = f"{where.per_node} rank{'s' if where.per_node > 1 else ''} on each" if where.per_node else "unevenly"
        if self.algorithm == "hier":
            costs = f"hier {ms(self.hier_s)} (flat {ms(self.flat_s)})"
        elif self.hier_s is not None:
            costs = f"flat {ms(self.flat_s)} (hier {ms(self.hier_s)})"
        else:
            costs = f"flat {ms(self.flat_s)} ({self._no_hier()})"
        return f"{axis} {self.op.replace('_', '-')} spans {where.nodes} nodes, {ranks}: {costs}"

    def _no_hier(self) -> str:
        if "all_to_all" in self.op:
            return "in two levels the same bytes cross nodes"
        return "one rank per node" if self.where.per_node == 1 else "no two levels on uneven nodes"


def price(profile: HardwareProfile, op: str, nbytes: float, where: Placement) -> Priced:
    """`op` of `nbytes` on a group placed `where`: flat, and in two levels where it applies."""
    flat = collective_seconds(profile, op, nbytes, where.size, where.spans)
    if not where.spans or where.per_node < 2 or op not in HIER_STEPS:
        return Priced(op, where, flat)
    return Priced(op, where, flat, hierarchical_seconds(profile, op, nbytes, where.nodes, where.per_node))

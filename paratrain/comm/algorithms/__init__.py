"""Collective algorithms written over point-to-point (a `Link`), one module per family, those
over a shared segment (shared.py), for groups of one host's processes only, and the backend's
own (backend.py, "native"), and those in two levels for a group that spans hosts
(hierarchical.py, "hier").

`ALGORITHMS[op][name]` is the function, called as algorithm(link, *buffers, [root], [reduce
op]) (a hierarchical one gets the group's Hierarchy instead of a Link: its messages are its
subgroups' collectives); "auto" is resolved by the Group to one of them, not here.
"""

from paratrain.comm.algorithms import backend, direct, halving_doubling, hierarchical, ring, shared, tree
from paratrain.comm.algorithms.shared import SHARED_ALGORITHMS

ALGORITHMS = {
    "all_reduce": {
        "ring": ring.all_reduce,
        "hd": halving_doubling.all_reduce,
        "tree": tree.all_reduce,
        "direct": direct.all_reduce,
        "oneshot": shared.all_reduce,
        "twoshot": shared.all_reduce_twoshot,
        "hier": hierarchical.all_reduce,
        "native": backend.all_reduce,
    },
    "reduce_scatter": {
        "ring": ring.reduce_scatter,
        "hd": halving_doubling.reduce_scatter,
        "direct": direct.reduce_scatter,
        "oneshot": shared.reduce_scatter,
        "hier": hierarchical.reduce_scatter,
        "native": backend.reduce_scatter,
    },
    "all_gather": {
        "ring": ring.all_gather,
        "hd": halving_doubling.all_gather,
        "direct": direct.all_gather,
        "oneshot": shared.all_gather,
        "hier": hierarchical.all_gather,
        "native": backend.all_gather,
    },
    "broadcast": {"ring": ring.broadcast, "tree": tree.broadcast, "direct": direct.broadcast,
                  "oneshot": shared.broadcast, "hier": hierarchical.broadcast, "native": backend.broadcast},
    "reduce": {"ring": ring.reduce, "tree": tree.reduce, "direct": direct.reduce, "oneshot": shared.reduce,
               "native": backend.reduce},
    "all_to_all": {"ring": ring.all_to_all, "direct": direct.all_to_all, "oneshot": shared.all_to_all,
                   "hier": hierarchical.all_to_all, "native": backend.all_to_all},
    # A barrier is an all-reduce of one element, so it can use any all-reduce algorithm; `direct`'s
    # is every rank to every other, which names a rank lost in it on every survivor.
    "barrier": {
        "ring": ring.all_reduce,
        "hd": halving_doubling.all_reduce,
        "tree": tree.all_reduce,
        "direct": direct.barrier,
        "oneshot": shared.barrier,
        "native": backend.barrier,
    },
}

OPS = tuple(ALGORITHMS)

# The all_to_all algorithms that take split sizes (uneven parts, as mixture-of-experts routing
# makes them); the ring's shifts pass equal parts along.
UNEVEN_ALL_TO_ALL = ("direct", "oneshot", "hier", "native")
# Those that run through the group's Hierarchy (hierarchy.py) rather than a Link.
HIERARCHICAL = frozenset({"hier"})


def check_takes_splits(algo: str, kind: str | None) -> None:
    """Raise where `algo` is an all_to_all algorithm of equal parts only (an unknown name is
    left to the Group's usual check, which lists the valid ones)."""
    if algo in ALGORITHMS["all_to_all"] and algo not in UNEVEN_ALL_TO_ALL:
        valid = ", ".join(name for name in algorithms_for("all_to_all", kind) if name in UNEVEN_ALL_TO_ALL + ("auto",))
        raise ValueError(f"all_to_all: algorithm {algo!r} takes equal parts only; with split sizes, valid: {valid}")


def algorithms_for(op: str, kind: str | None = None, spans_hosts: bool = False) -> tuple[str, ...]:
    """Every algorithm name valid for `op` on a transport of `kind`, auto included. The
    shared-segment ones only where `kind` is "shm" (or "any": every name there is); the
    hierarchical ones only in a group that `spans_hosts` (or for "any"); None: those valid on
    every transport."""
    shared_too, hier_too = kind in ("shm", "any"), spans_hosts or kind == "any"
    return tuple(name for name in ALGORITHMS[op] if (shared_too or name not in SHARED_ALGORITHMS)
                 and (hier_too or name not in HIERARCHICAL)) + ("auto",)

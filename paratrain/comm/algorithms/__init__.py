"""Collective algorithms written over point-to-point (a `Link`), one module per family.

`ALGORITHMS[op][name]` is the function; "native" (the backend's own collective) and "auto"
are resolved by the Group, not here.
"""

from paratrain.comm.algorithms import direct, halving_doubling, ring, tree

ALGORITHMS = {
    "all_reduce": {
        "ring": ring.all_reduce,
        "hd": halving_doubling.all_reduce,
        "tree": tree.all_reduce,
        "direct": direct.all_reduce,
    },
    "reduce_scatter": {
        "ring": ring.reduce_scatter,
        "hd": halving_doubling.reduce_scatter,
        "direct": direct.reduce_scatter,
    },
    "all_gather": {
        "ring": ring.all_gather,
        "hd": halving_doubling.all_gather,
        "direct": direct.all_gather,
    },
    "broadcast": {"ring": ring.broadcast, "tree": tree.broadcast, "direct": direct.broadcast},
    "reduce": {"ring": ring.reduce, "tree": tree.reduce, "direct": direct.reduce},
    "all_to_all": {"ring": ring.all_to_all, "direct": direct.all_to_all},
    # A barrier is an all-reduce of one element, so it can use any all-reduce algorithm.
    "barrier": {
        "ring": ring.all_reduce,
        "hd": halving_doubling.all_reduce,
        "tree": tree.all_reduce,
        "direct": direct.all_reduce,
    },
}

OPS = tuple(ALGORITHMS)


def algorithms_for(op: str) -> tuple[str, ...]:
    """Every algorithm name valid for `op`, including the backend's own and auto."""
    return tuple(ALGORITHMS[op]) + ("native", "auto")

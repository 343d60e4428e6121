"""Context parallelism: each rank of a context group holds part of every sequence, and attention,
the one layer that mixes positions, meets the rest of the sequence by ring or all-gather.

    layout.py      which chunks of a sequence a rank holds (zigzag, contiguous), their positions,
                   and the attention work that gives each rank
    blocks.py      one block's attention forward and backward, merged by log-sum-exp
    ring.py        ring attention: K/V passed round the group, dK/dV one hop behind in backward
    allgather.py   the all-gather variant: K/V gathered once per layer, dK/dV reduce-scattered
    attention.py   `context_attention`, the call a model's attention makes under cp > 1
    apply.py       a model's attention calls captured and its position buffers cut, as its plan says
"""

from paratrain.parallel.context.attention import METHODS, context_attention
from paratrain.parallel.context.layout import LAYOUTS, attention_work, positions, shard, unshard

__all__ = ["LAYOUTS", "METHODS", "attention_work", "context_attention", "positions", "shard", "unshard"]

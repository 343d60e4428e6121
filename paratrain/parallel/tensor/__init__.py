"""Tensor parallelism (Megatron-style): each layer's weights split over the tp ranks.

    parallelize.py    parallelize: a plan's styles applied to any model (../plan.py reads plans);
                      gather_full_state: the unsharded weights again (checkpoints, parity checks)
    gpt.py            parallelize_gpt: the GPT's plan through that same path; tp_problems
    layers.py         column-/row-parallel linears and the vocab-parallel embedding, each
                      built from an existing layer by slicing its weights for this rank
    cross_entropy.py  the loss of vocabulary-sharded logits, never gathered
    tp_comms.py       the conjugate autograd functions (f/g, sequence scatter/gather)

    model = parallelize_gpt(build_seeded_model("gpt-tiny", {}, seed), mesh.tp)
    loss = vocab_parallel_cross_entropy(model(idx_BT), targets_BT, mesh.tp)
"""

from paratrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from paratrain.parallel.tensor.gpt import parallelize_gpt, tp_problems
from paratrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceShardedEmbedding,
    VocabParallelEmbedding,
    shard,
)
from paratrain.parallel.tensor.parallelize import gather_full_state, parallelize, sequence_sharded_parameters
from paratrain.parallel.tensor.tp_comms import (
    all_gather_along,
    copy_to_parallel,
    gather_sequence,
    reduce_from_parallel,
    reduce_scatter_sequence,
    scatter_sequence,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "SequenceShardedEmbedding", "VocabParallelEmbedding",
    "all_gather_along", "copy_to_parallel", "gather_full_state", "gather_sequence",
    "parallelize", "parallelize_gpt", "reduce_from_parallel", "reduce_scatter_sequence", "scatter_sequence",
    "sequence_sharded_parameters", "shard", "tp_problems", "vocab_parallel_cross_entropy",
]

"""The GPT's tensor parallelism: whether a GPT configuration splits over tp ranks (tp_problems),
and parallelize_gpt, its plan (models/plans.py: GPT_PLAN) applied through the one path every
model's plan takes (parallelize.py). The plan says:

    tok_emb            -> VocabParallelEmbedding   (vocabulary ranges; sum over ranks)
    blocks[i].attn.qkv -> ColumnParallelLinear     (whole heads: each rank its heads' q, k, v)
    blocks[i].attn.proj-> RowParallelLinear        (all-reduce after)
    blocks[i].mlp.up   -> ColumnParallelLinear     (d_mlp split)
    blocks[i].mlp.down -> RowParallelLinear        (all-reduce after)
    head               -> ColumnParallelLinear     (local vocabulary logits, never gathered:
                                                    use vocab_parallel_cross_entropy)

The vocabulary ranges of tok_emb and head are part_bounds(V, tp): equal when tp divides V,
else the first V % tp ranks hold one more id (GPT-2's 50257 over tp = 2: 25129 and 25128).

Everything else (pos_emb, the layer norms, row-parallel biases) stays replicated: its inputs
are the same on every tp rank, so are its gradients, with no communication.

sequence_parallel=True also shards the activations along the sequence where they are
replicated (embeddings, norms, residual adds, dropout): row-parallel layers and the token
embedding reduce-scatter instead of all-reduce, and the inputs of attn, mlp and head are
all-gathered at the module boundary (attention reads the sequence length from its input,
so the gather cannot live inside qkv). The same bytes move, but no rank holds the full
(B, T, D) activations between blocks. The layer norms' and row-parallel biases' gradients
then cover only each rank's tokens: a hook parallelize registers all-reduces them over tp as
backward produces them (per backward pass, so gradient accumulation stays correct), and the
caller need do nothing. The sequence length must then be divisible by tp.

Dropout must be 0 (tp_problems says so): the replicated activations need the same dropout
mask on every tp rank, and nothing here keeps the ranks' random number generators in step.
"""

from __future__ import annotations

from torch import nn

from paratrain.models.plans import GPT_PLAN
from paratrain.parallel.tensor.parallelize import parallelize


def tp_problems(config, tp: int) -> list[str]:
    """One line per reason `config` (a GPTConfig) cannot be split over `tp` ranks.

    The vocabulary need not divide: it is split by part_sizes' rule (the first V % tp ranks
    hold one more id), so GPT-2's 50257 splits over any tp.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        return [f"tp must be a positive integer, got {tp!r}"]
    problems = []
    for field, why in (
        ("n_head", "each rank computes whole attention heads"),
        ("d_mlp", "each rank holds an equal slice of the MLP's hidden units"),
    ):
        value = getattr(config, field)
        if value % tp:
            problems.append(f"{field} ({value}) must be divisible by tp ({tp}): {why}")
    if tp > 1 and config.dropout:
        problems.append(
            f"dropout ({config.dropout}) must be 0 with tp > 1: replicated activations would "
            "need the same dropout mask on every tensor-parallel rank"
        )
    return problems


def parallelize_gpt(model: nn.Module, tp_group, sequence_parallel: bool = False) -> nn.Module:
    """Shard `model`'s layers over `tp_group`, in place, by the GPT's plan (models/plans.py)
    through the one path every model's plan takes (parallelize.parallelize); returns the model.

    Every rank must pass the same unsharded weights (build the model from one seed).
    Submodules a pipeline stage does not use are still sharded; parameter names are unchanged.
    """
    problems = tp_problems(model.config, tp_group.size)
    if problems:
        raise ValueError("cannot apply tensor parallelism:\n  " + "\n  ".join(problems))
    return parallelize(model, GPT_PLAN, tp_group, sequence_parallel=sequence_parallel)

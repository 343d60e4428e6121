"""Cross-entropy of logits sharded on the vocabulary, without ever gathering them.

Each tp rank holds logits_NV_shard, the columns part_bounds(V, tp)[r] of the full logits_NV
(N tokens): V/tp each, or one more on the first V % tp ranks when tp does not divide V.
Gathering them would cost N x V per rank (at GPT-2's vocabulary, most of the activation
memory); instead three per-token numbers are reduced:

    m_N       = max over V of logits         all-reduce(max)    for a stable exp
    sumexp_N  = sum over V of exp(logit - m)  all-reduce(sum) \\  one message: the two sums
    target_N  = logit[target] - m             all-reduce(sum) /  travel together
    loss_N    = log(sumexp_N) - target_N      (the owner of the target contributes it, the
                                               other ranks zero)

Backward needs no communication: d loss_N / d logits = softmax - onehot(target), and each
rank computes it on its own columns (softmax from the reduced sumexp, onehot only where it
owns the target). The result is the mean over tokens, as F.cross_entropy's default.

Shape legend: N tokens (B * T flattened), V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paratrain.comm.ops import part_bounds
from paratrain.parallel.tensor.tp_comms import all_reduce_copy


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV_shard, targets_N, group, vocab_start):
        V_shard = logits_NV_shard.shape[-1]
        max_N = all_reduce_copy(logits_NV_shard.max(dim=-1).values, group, op="max")
        shifted_NV = logits_NV_shard - max_N.unsqueeze(-1)

        local_N = targets_N - vocab_start
        owned_N = (local_N >= 0) & (local_N < V_shard)
        local_N = local_N.masked_fill(~owned_N, 0)
        target_N = shifted_NV.gather(-1, local_N.unsqueeze(-1)).squeeze(-1).masked_fill(~owned_N, 0.0)

        exp_NV = shifted_NV.exp_()  # shifted_NV is ours: exponentiate it in place
        sums_2N = all_reduce_copy(torch.stack([exp_NV.sum(dim=-1), target_N]), group)
        sumexp_N, target_N = sums_2N[0], sums_2N[1]
        loss_N = sumexp_N.log() - target_N

        softmax_NV = exp_NV.div_(sumexp_N.unsqueeze(-1))
        ctx.save_for_backward(softmax_NV, local_N, owned_N)
        return loss_N.mean()

    @staticmethod
    def backward(ctx, grad_loss):
        softmax_NV, local_N, owned_N = ctx.saved_tensors
        onehot_N1 = owned_N.to(softmax_NV.dtype).unsqueeze(-1)
        grad_NV = softmax_NV.scatter_add(-1, local_N.unsqueeze(-1), -onehot_N1)
        return grad_NV * (grad_loss / softmax_NV.shape[0]), None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, group, vocab_size: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy over all tokens, equal to F.cross_entropy of the gathered logits.

    logits_shard: (..., V_shard), this rank's contiguous vocabulary range,
    part_bounds(vocab_size, tp)[rank] (the layout of the parallelized head); targets: (...),
    ids into the full vocabulary. vocab_size: the full V; left out, it is summed over the
    ranks' shard widths (one small all-reduce per call, so pass it where it is known). Every
    tp rank gets the same loss. With one rank it is F.cross_entropy itself.
    """
    if targets.shape != logits_shard.shape[:-1]:
        raise ValueError(
            f"vocab_parallel_cross_entropy: targets of shape {tuple(targets.shape)} do not match "
            f"logits of shape {tuple(logits_shard.shape)} (expected {tuple(logits_shard.shape[:-1])})"
        )
    V_shard = logits_shard.shape[-1]
    # In fp32 whatever the logits' dtype, as autocast runs F.cross_entropy: a custom Function
    # is not autocast, and a bf16 softmax would round the loss to multiples of 1/128.
    logits_NV_shard, targets_N = logits_shard.reshape(-1, V_shard).float(), targets.reshape(-1)
    if group.size == 1:
        return F.cross_entropy(logits_NV_shard, targets_N)
    if vocab_size is None:
        width = torch.tensor([V_shard], dtype=torch.int64, device=logits_shard.device)
        vocab_size = int(all_reduce_copy(width, group).item())
    vocab_start, vocab_end = part_bounds(vocab_size, group.size)[group.rank]
    if V_shard != vocab_end - vocab_start:
        raise ValueError(
            f"vocab_parallel_cross_entropy: rank {group.rank} holds {V_shard} logits, but its part "
            f"of a vocabulary of {vocab_size} over {group.size} ranks is [{vocab_start}, {vocab_end})"
        )
    if targets_N.numel() and (targets_N.min() < 0 or targets_N.max() >= vocab_size):
        raise ValueError(
            f"vocab_parallel_cross_entropy: targets must lie in [0, {vocab_size}), got "
            f"[{int(targets_N.min())}, {int(targets_N.max())}]"
        )
    return _VocabParallelCrossEntropy.apply(logits_NV_shard, targets_N, group, vocab_start)

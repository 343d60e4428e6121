"""Tensor parallelism equals the single-device computation it shards.

Each sharded layer is compared with the plain layer built from the same unsharded weights;
the vocab-parallel loss with F.cross_entropy of the full logits (a whole parallelized GPT
against the unsharded one: test_tensor_parallel_gpt.py). Vocabularies that tp
does not divide (257, GPT-2's 50257) are split unevenly, by torch.tensor_split's rule, and
are held to the same tolerances.

Tolerances (fp32). Sharding changes only the order of additions: a row-parallel output and
a column-parallel input gradient become a sum of tp partial dot products, the softmax
denominator a sum of tp partial sums, and BLAS blocks a narrower matrix product differently.
Each moves a result by an ulp or two. So tensors agree to TOL = 1e-6 of their scale (the
reference's largest magnitude, or 1): measured at most 1.6e-7 for the layers, 3.0e-7 for
the GPT's logits, 3.0e-8 for its gradients and 1.2e-7 for its parameters after 4 SGD steps
(the odd vocabularies measure the same as the even ones).
Losses agree to LOSS_RTOL = 1e-5 relative (measured 1.7e-7). With tp = 1 nothing is
reordered and every result is bitwise equal. Communication tests use integer-valued floats,
whose sums are exact in any order, and compare exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paratrain import run
from paratrain.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_gather_along,
    copy_to_parallel,
    gather_full_state,
    gather_sequence,
    reduce_from_parallel,
    reduce_scatter_sequence,
    scatter_sequence,
    vocab_parallel_cross_entropy,
)

TOL = 1e-6
LOSS_RTOL = 1e-5
TP_SIZES = [1, 2, 4]


def randn(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def small_ints(seed: int, *shape) -> torch.Tensor:
    """Integer-valued floats: sums of a few of them are exact in any order."""
    return torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(seed)).float()


def make_linear(in_features: int, out_features: int, seed: int, bias: bool = True) -> nn.Linear:
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(randn(seed, out_features, in_features) / in_features**0.5)
        if bias:
            linear.bias.copy_(randn(seed + 1, out_features))
    return linear


def columns(tensor: torch.Tensor, rank: int, size: int, dim: int = -1) -> torch.Tensor:
    """Rank's contiguous part of `dim` by torch.tensor_split's rule (equal parts when size
    divides the length, else the first length % size parts one longer), taken from torch
    rather than from the library under test."""
    return tensor.tensor_split(size, dim=dim)[rank]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str, tol: float = TOL) -> None:
    """Max |ours - ref| within `tol` of the reference's scale (its largest magnitude, or 1)."""
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    diff, scale = (ours - ref).abs().max().item(), max(1.0, ref.abs().max().item())
    assert diff <= tol * scale, f"{what}: max |diff| {diff:.2e} > {tol:.0e} x scale {scale:.2g}"


# ---- communication ------------------------------------------------------------------------


def conjugate_pairs_rank(group):
    rank, size = group.rank, group.size
    x_BTD = small_ints(0, 2, 8, 3)
    grad_BTD = small_ints(1, 2, 8, 3)
    mine_BTD = small_ints(10 + rank, 2, 8, 3)  # differs per rank
    out = {}

    x = x_BTD.clone().requires_grad_()
    copied = copy_to_parallel(x, group)
    copied.backward(mine_BTD)
    out["copy"] = (copied.detach(), x.grad)

    x = mine_BTD.clone().requires_grad_()
    reduced = reduce_from_parallel(x, group)
    reduced.backward(grad_BTD)
    out["reduce"] = (reduced.detach(), x.grad)

    x = x_BTD.clone().requires_grad_()
    scattered = scatter_sequence(x, group)
    scattered.backward(columns(grad_BTD, rank, size, dim=1))
    out["scatter"] = (scattered.detach(), x.grad)

    x = columns(x_BTD, rank, size, dim=1).clone().requires_grad_()
    gathered = gather_sequence(x, group)
    gathered.backward(mine_BTD)
    out["gather"] = (gathered.detach(), x.grad)

    x = mine_BTD.clone().requires_grad_()
    summed = reduce_scatter_sequence(x, group)
    summed.backward(columns(grad_BTD, rank, size, dim=1))
    out["reduce_scatter"] = (summed.detach(), x.grad)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_comms_are_conjugate_pairs(tp):
    x_BTD, grad_BTD = small_ints(0, 2, 8, 3), small_ints(1, 2, 8, 3)
    total_BTD = sum(small_ints(10 + r, 2, 8, 3) for r in range(tp))
    for rank, out in run(conjugate_pairs_rank, tp).items():
        mine = lambda t: columns(t, rank, tp, dim=1)  # noqa: E731
        expected = {
            "copy": (x_BTD, total_BTD),  # identity forward, all-reduce backward
            "reduce": (total_BTD, grad_BTD),  # all-reduce forward, identity backward
            "scatter": (mine(x_BTD), grad_BTD),  # my part forward, all-gather backward
            "gather": (x_BTD, mine(total_BTD)),  # all-gather forward, reduce-scatter backward
            "reduce_scatter": (mine(total_BTD), grad_BTD),  # reduce-scatter fwd, all-gather bwd
        }
        for name, (forward, backward) in expected.items():
            assert torch.equal(out[name][0], forward), f"rank {rank} {name} forward"
            assert torch.equal(out[name][1], backward), f"rank {rank} {name} backward"


def uneven_gather_rank(group, length):
    rows = columns(small_ints(2, length, 3), group.rank, group.size, dim=0)
    cols = columns(small_ints(3, 2, length), group.rank, group.size, dim=-1)
    return all_gather_along(rows, group, 0, length=length), all_gather_along(cols, group, -1, length=length)


@pytest.mark.parametrize("tp", [2, 4])
def test_all_gather_along_reassembles_uneven_parts(tp):
    length = 4 * tp + 3  # the first 3 ranks hold one more
    for rank, (rows, cols) in run(uneven_gather_rank, tp, args=(length,)).items():
        assert torch.equal(rows, small_ints(2, length, 3)), f"rank {rank} rows"
        assert torch.equal(cols, small_ints(3, 2, length)), f"rank {rank} columns"


# ---- layers -------------------------------------------------------------------------------


def column_parallel_rank(group):
    linear = make_linear(16, 24, seed=0)
    layer = ColumnParallelLinear(linear, group)
    x = randn(2, 3, 5, 16).requires_grad_()
    y = layer(x)
    y.backward(columns(randn(3, 3, 5, 24), group.rank, group.size))
    return {"y": y.detach(), "x.grad": x.grad, "weight.grad": layer.weight.grad, "bias.grad": layer.bias.grad}


@pytest.mark.parametrize("tp", TP_SIZES)
def test_column_parallel_linear_matches_single_device(tp):
    linear = make_linear(16, 24, seed=0)
    x = randn(2, 3, 5, 16).requires_grad_()
    y = linear(x)
    y.backward(randn(3, 3, 5, 24))
    for rank, out in run(column_parallel_rank, tp).items():
        assert_close(out["y"], columns(y.detach(), rank, tp), f"rank {rank} output")
        assert_close(out["x.grad"], x.grad, f"rank {rank} input grad (all-reduced)")
        assert_close(out["weight.grad"], columns(linear.weight.grad, rank, tp, dim=0), f"rank {rank} weight grad")
        assert_close(out["bias.grad"], columns(linear.bias.grad, rank, tp, dim=0), f"rank {rank} bias grad")


def fused_qkv_rank(group):
    qkv = make_linear(32, 3 * 32, seed=4)
    layer = ColumnParallelLinear(qkv, group, fused_parts=3)
    return layer(randn(5, 2, 32)).detach(), gather_full_state(layer, group)


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_qkv_split_gives_each_rank_the_same_heads_q_k_and_v(tp):
    qkv = make_linear(32, 3 * 32, seed=4)  # 8 heads of width 4, output [q | k | v]
    q, k, v = qkv(randn(5, 2, 32)).detach().chunk(3, dim=-1)
    for rank, (y, full) in run(fused_qkv_rank, tp).items():
        expected = torch.cat([columns(t, rank, tp) for t in (q, k, v)], dim=-1)
        assert_close(y, expected, f"rank {rank} [q | k | v] of its heads")
        assert torch.equal(full["weight"], qkv.weight) and torch.equal(full["bias"], qkv.bias)


def row_parallel_rank(group):
    linear = make_linear(24, 16, seed=6)
    layer = RowParallelLinear(linear, group)
    x = columns(randn(7, 3, 5, 24), group.rank, group.size).clone().requires_grad_()
    y = layer(x)
    y.backward(randn(8, 3, 5, 16))
    return {"y": y.detach(), "x.grad": x.grad, "weight.grad": layer.weight.grad, "bias.grad": layer.bias.grad}


@pytest.mark.parametrize("tp", TP_SIZES)
def test_row_parallel_linear_matches_single_device(tp):
    linear = make_linear(24, 16, seed=6)
    x = randn(7, 3, 5, 24).requires_grad_()
    y = linear(x)
    y.backward(randn(8, 3, 5, 16))
    results = run(row_parallel_rank, tp)
    for rank, out in results.items():
        assert_close(out["y"], y.detach(), f"rank {rank} output (all-reduced)")
        assert_close(out["x.grad"], columns(x.grad, rank, tp), f"rank {rank} input grad")
        assert_close(out["weight.grad"], columns(linear.weight.grad, rank, tp), f"rank {rank} weight grad")
        assert_close(out["bias.grad"], linear.bias.grad, f"rank {rank} bias grad")
        # The replicated bias sees the same (all-reduced) input everywhere: same gradient, bit for bit.
        assert torch.equal(out["bias.grad"], results[0]["bias.grad"])


WIDTH = 6
# 40 divides by every tp tested; 257 and GPT-2's 50257 by none, so their ranks' ranges differ.
VOCABS = [40, 257, 50257]


def vocab_ids(vocab: int) -> torch.Tensor:
    """Every id once (so every shard is hit) and some repeats, in a scrambled order, (4, -1)."""
    g = torch.Generator().manual_seed(9)
    repeats = 24 + (-(vocab + 24)) % 4
    ids = torch.cat([torch.arange(vocab), torch.randint(vocab, (repeats,), generator=g)])
    return ids[torch.randperm(ids.numel(), generator=g)].view(4, -1)


def targets_at_edges(vocab: int, seed: int) -> torch.Tensor:
    """(3, 7) targets, scrambled: the first and last id of every rank's range at tp 2 and 4
    (where an off-by-one in a range's bounds would show), the rest random."""
    parts = [part for tp in (2, 4) for part in torch.arange(vocab).tensor_split(tp)]
    edges = torch.tensor(sorted({int(i) for part in parts for i in (part[0], part[-1])}))
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([edges, torch.randint(vocab, (21 - edges.numel(),), generator=g)])
    return ids[torch.randperm(21, generator=g)].view(3, 7)


def make_embedding(vocab: int) -> nn.Embedding:
    embedding = nn.Embedding(vocab, WIDTH)
    with torch.no_grad():
        embedding.weight.copy_(randn(11, vocab, WIDTH))
    return embedding


def vocab_embedding_rank(group, vocab):
    layer = VocabParallelEmbedding(make_embedding(vocab), group)
    idx = vocab_ids(vocab)
    out = layer(idx)
    out.backward(randn(12, *idx.shape, WIDTH))
    return out.detach(), layer.weight.grad, gather_full_state(layer, group)["weight"]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_vocab_parallel_embedding_matches_single_device(tp, vocab):
    embedding = make_embedding(vocab)
    idx = vocab_ids(vocab)
    out = embedding(idx)
    out.backward(randn(12, *idx.shape, WIDTH))
    for rank, (ours, weight_grad, full) in run(vocab_embedding_rank, tp, args=(vocab,)).items():
        # One rank contributes each row and the others add exact zeros: equal bit for bit.
        assert torch.equal(ours, out.detach()), f"rank {rank} lookup"
        assert torch.equal(weight_grad, columns(embedding.weight.grad, rank, tp, dim=0)), f"rank {rank} grad"
        assert torch.equal(full, embedding.weight.detach()), f"rank {rank} gathered table"


def cross_entropy_inputs(vocab: int):
    logits_BTV = 10 * randn(13, 3, 7, vocab)  # wide logits: the max shift matters
    return logits_BTV, targets_at_edges(vocab, seed=14)


def cross_entropy_rank(group, vocab, give_vocab_size):
    logits_BTV, targets_BT = cross_entropy_inputs(vocab)
    shard = columns(logits_BTV, group.rank, group.size).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, targets_BT, group, vocab if give_vocab_size else None)
    loss.backward()
    return loss.detach(), shard.grad


@pytest.mark.parametrize("give_vocab_size", [True, False], ids=["vocab-given", "vocab-summed"])
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(tp, vocab, give_vocab_size):
    logits_BTV, targets_BT = cross_entropy_inputs(vocab)
    logits_BTV.requires_grad_()
    loss = F.cross_entropy(logits_BTV.reshape(-1, vocab), targets_BT.reshape(-1))
    loss.backward()
    for rank, (ours, grad) in run(cross_entropy_rank, tp, args=(vocab, give_vocab_size)).items():
        assert_close(ours, loss.detach(), f"rank {rank} loss")
        assert_close(grad, columns(logits_BTV.grad, rank, tp), f"rank {rank} logits grad")


HEAD_VOCAB, HEAD_WIDTH = 257, 8


def head_inputs():
    return randn(15, 3, 7, HEAD_WIDTH), targets_at_edges(HEAD_VOCAB, seed=16)


def head_and_loss_rank(group):
    layer = ColumnParallelLinear(make_linear(HEAD_WIDTH, HEAD_VOCAB, seed=17, bias=False), group)
    x_BTD, targets_BT = head_inputs()
    x_BTD.requires_grad_()
    loss = vocab_parallel_cross_entropy(layer(x_BTD), targets_BT, group, HEAD_VOCAB)
    loss.backward()
    return {
        "loss": loss.detach(),
        "x.grad": x_BTD.grad,
        "weight.grad": layer.weight.grad,
        "full weight": gather_full_state(layer, group)["weight"],
        "full weight.grad": gather_full_state(layer, group, grads=True)["weight"],
    }


@pytest.mark.parametrize("tp", TP_SIZES)
def test_uneven_vocab_head_and_cross_entropy_match_single_device(tp):
    head = make_linear(HEAD_WIDTH, HEAD_VOCAB, seed=17, bias=False)
    x_BTD, targets_BT = head_inputs()
    x_BTD.requires_grad_()
    loss = F.cross_entropy(head(x_BTD).reshape(-1, HEAD_VOCAB), targets_BT.reshape(-1))
    loss.backward()
    for rank, out in run(head_and_loss_rank, tp).items():
        assert_close(out["loss"], loss.detach(), f"rank {rank} loss")
        assert_close(out["x.grad"], x_BTD.grad, f"rank {rank} input grad (all-reduced)")
        mine = columns(head.weight.grad, rank, tp, dim=0)
        assert_close(out["weight.grad"], mine, f"rank {rank} weight grad")
        assert torch.equal(out["full weight"], head.weight.detach()), f"rank {rank} gathered weight"
        assert_close(out["full weight.grad"], head.weight.grad, f"rank {rank} gathered weight grad")


def test_vocab_parallel_cross_entropy_names_bad_targets():
    def bad_targets(group):
        vocab_parallel_cross_entropy(torch.zeros(2, 3, 4), torch.full((2, 3), 8), group)

    with pytest.raises(ValueError, match=r"targets must lie in \[0, 8\), got \[8, 8\]"):
        run(bad_targets, 2)


class StoredTransposed(nn.Module):
    """transformers' Conv1D as GPT-2 uses it: weight (in, out), y = x W + b (`nf` out, `nx` in)."""

    def __init__(self, nx: int, nf: int, seed: int):
        super().__init__()
        self.nx, self.nf = nx, nf
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(nx, nf, generator=g))
        self.bias = nn.Parameter(torch.randn(nf, generator=g))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, self.nx), self.weight).view(*x.shape[:-1], self.nf)


def stored_transposed_rank(group):
    up, down = StoredTransposed(8, 3 * 8, seed=1), StoredTransposed(3 * 8, 8, seed=2)
    column, row = ColumnParallelLinear(up, group), RowParallelLinear(down, group)
    fused = ColumnParallelLinear(StoredTransposed(8, 3 * 12, seed=3), group, fused_parts=3)  # [q | k | v]
    x = randn(9, 4, 8).requires_grad_()
    y = row(column(x))
    y.backward(torch.ones_like(y))
    return (y.detach(), x.grad, gather_full_state(column, group), gather_full_state(row, group, grads=True),
            gather_full_state(fused, group))


@pytest.mark.parametrize("tp", [2, 3])
def test_weights_stored_in_out_split_in_their_own_layout_and_gather_back(tp):
    """GPT-2's Conv1D keeps its weight (in, out): split there, the layers give the single-device
    output and gradients, and gathering gives back the weights in the same layout."""
    up, down = StoredTransposed(8, 3 * 8, seed=1), StoredTransposed(3 * 8, 8, seed=2)
    x = randn(9, 4, 8).requires_grad_()
    y = down(up(x))
    y.backward(torch.ones_like(y))
    fused = StoredTransposed(8, 3 * 12, seed=3)
    for rank, (y_rank, x_grad, column_state, row_grads, fused_state) in run(stored_transposed_rank, tp).items():
        assert_close(y_rank, y.detach(), f"rank {rank} output")
        assert_close(x_grad, x.grad, f"rank {rank} input grad")
        assert torch.equal(column_state["weight"], up.weight) and torch.equal(column_state["bias"], up.bias)
        assert_close(row_grads["weight"], down.weight.grad, f"rank {rank} row weight grad")
        assert torch.equal(fused_state["weight"], fused.weight) and torch.equal(fused_state["bias"], fused.bias)

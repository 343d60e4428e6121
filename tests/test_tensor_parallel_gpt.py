"""A whole GPT parallelized by tensor parallelism equals the unsharded one: logits, loss and
gradients of a forward/backward, then a few SGD steps, with and without sequence parallelism
and with a vocabulary tp does not divide; with tp = 1 bit for bit, and without communicating.
Then the configurations tensor parallelism refuses, and why. Tolerances as in
test_tensor_parallel.py (whose layer tests these build on).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from paratrain import run
from paratrain.data import build_dataset
from paratrain.models import model_config
from paratrain.parallel.tensor import (
    all_gather_along,
    gather_full_state,
    parallelize_gpt,
    tp_problems,
    vocab_parallel_cross_entropy,
)
from paratrain.train.setup import build_seeded_model

from test_tensor_parallel import LOSS_RTOL, assert_close

SEED, STEPS, BATCH, LR = 0, 4, 8, 0.5

# ---- a whole GPT --------------------------------------------------------------------------


def gpt_overrides(vocab_size: int | None) -> dict:
    return {} if vocab_size is None else {"vocab_size": vocab_size}


def gpt_data(vocab_size: int | None):
    config = model_config("gpt-tiny", **gpt_overrides(vocab_size))
    return build_dataset("tokens", SEED, vocab_size=config.vocab_size, block_size=config.block_size)


def replicated_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {
        f"{module_name}.{name}" if module_name else name: param
        for module_name, module in model.named_modules()
        for name, param in module.named_parameters(recurse=False)
        if name not in getattr(module, "shard_layout", {})
    }


def train_parallel_gpt_rank(group, sequence_parallel: bool, vocab_size: int | None = None):
    model = build_seeded_model("gpt-tiny", gpt_overrides(vocab_size), SEED)
    model = parallelize_gpt(model, group, sequence_parallel)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data, losses, first = gpt_data(vocab_size), [], {}
    for step in range(STEPS):
        idx_BT, targets_BT = data.global_batch(step, BATCH)
        logits_BTV_shard = model(idx_BT)
        loss = vocab_parallel_cross_entropy(logits_BTV_shard, targets_BT, group)
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            first = {
                "logits": all_gather_along(logits_BTV_shard.detach(), group, -1, length=data.vocab_size),
                "grads": gather_full_state(model, group, grads=True),
                "replicated grads": {n: p.grad.clone() for n, p in replicated_parameters(model).items()},
            }
        optimizer.step()
        losses.append(loss.item())
    replicated = {n: p.detach().clone() for n, p in replicated_parameters(model).items()}
    return {**first, "losses": losses, "state": gather_full_state(model, group), "replicated": replicated}


@functools.cache
def single_device_gpt_run(vocab_size: int | None = None):
    model = build_seeded_model("gpt-tiny", gpt_overrides(vocab_size), SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data, losses, first = gpt_data(vocab_size), [], {}
    for step in range(STEPS):
        idx_BT, targets_BT = data.global_batch(step, BATCH)
        logits_BTV = model(idx_BT)
        loss = data.loss(logits_BTV, targets_BT)
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            first = {"logits": logits_BTV.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
        optimizer.step()
        losses.append(loss.item())
    return {**first, "losses": losses, "state": {n: p.detach().clone() for n, p in model.named_parameters()}}


GPT_LAYOUTS = [  # (tp, sequence_parallel, vocab_size: None for gpt-tiny's 256)
    pytest.param((1, False, None), id="tp1"),
    pytest.param((2, False, None), id="tp2"),
    pytest.param((4, False, None), id="tp4"),
    pytest.param((2, True, None), id="tp2-sequence-parallel"),
    pytest.param((4, True, None), id="tp4-sequence-parallel"),
    pytest.param((2, False, 257), id="tp2-vocab257"),
    pytest.param((4, False, 257), id="tp4-vocab257"),
    pytest.param((4, True, 257), id="tp4-sequence-parallel-vocab257"),
]


@pytest.fixture(scope="module", params=GPT_LAYOUTS)
def parallel_gpt_run(request):
    tp, sequence_parallel, vocab_size = request.param
    return tp, vocab_size, run(train_parallel_gpt_rank, tp, args=(sequence_parallel, vocab_size))


def test_parallel_gpt_logits_loss_and_gradients_match_single_device(parallel_gpt_run):
    tp, vocab_size, results = parallel_gpt_run
    ref = single_device_gpt_run(vocab_size)
    for rank, out in results.items():
        assert_close(out["logits"], ref["logits"], f"rank {rank} logits")
        assert abs(out["losses"][0] - ref["losses"][0]) <= LOSS_RTOL * ref["losses"][0]
        assert out["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            assert_close(out["grads"][name], grad, f"rank {rank} grad of {name}")


def test_replicated_parameters_get_identical_gradients_on_every_tp_rank(parallel_gpt_run):
    tp, vocab_size, results = parallel_gpt_run
    first = results[0]["replicated grads"]
    assert {"pos_emb.weight", "ln_f.weight", "blocks.0.attn.proj.bias", "blocks.1.mlp.down.bias"} <= first.keys()
    for rank, out in results.items():
        for name, grad in first.items():
            assert torch.equal(out["replicated grads"][name], grad), f"rank {rank} {name}"
            assert torch.equal(out["replicated"][name], results[0]["replicated"][name]), f"rank {rank} {name}"


def test_parallel_gpt_trains_like_single_device(parallel_gpt_run):
    tp, vocab_size, results = parallel_gpt_run
    ref = single_device_gpt_run(vocab_size)
    for rank, out in results.items():
        for step, (ours, theirs) in enumerate(zip(out["losses"], ref["losses"], strict=True)):
            assert abs(ours - theirs) <= LOSS_RTOL * theirs, f"rank {rank} step {step}: {ours} vs {theirs}"
            if tp == 1:
                assert ours == theirs, "tp = 1 must be the plain model, bit for bit"
        assert out["state"].keys() == ref["state"].keys()
        for name, param in ref["state"].items():
            assert_close(out["state"][name], param, f"rank {rank} {name}")
            if tp == 1:
                assert torch.equal(out["state"][name], param), name


def silent_rank(group):
    """A group of one whose collectives all fail: tensor parallelism must not call them."""

    def refuse(*args, **kwargs):
        raise AssertionError("tp = 1 must not communicate")

    for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        setattr(group, name, refuse)
    return train_parallel_gpt_rank(group, sequence_parallel=True)


def test_tp1_is_the_plain_model_and_never_communicates():
    out = run(silent_rank, 1)[0]
    ref = single_device_gpt_run()
    assert torch.equal(out["logits"], ref["logits"])
    assert out["losses"] == ref["losses"]


# ---- configuration ------------------------------------------------------------------------


def test_tp_problems_name_each_field_that_does_not_divide():
    # vocab_size 250 is no problem at tp 4: the vocabulary is split unevenly.
    config = model_config("gpt-tiny", n_head=6, d_model=96, d_mlp=198, vocab_size=250, dropout=0.1)
    problems = tp_problems(config, 4)
    assert problems == [
        "n_head (6) must be divisible by tp (4): each rank computes whole attention heads",
        "d_mlp (198) must be divisible by tp (4): each rank holds an equal slice of the MLP's hidden units",
        "dropout (0.1) must be 0 with tp > 1: replicated activations would need the same dropout mask "
        "on every tensor-parallel rank",
    ]
    assert tp_problems(config, 2) == [problems[-1]]
    assert tp_problems(config, 1) == []
    assert tp_problems(model_config("gpt-tiny"), 0) == ["tp must be a positive integer, got 0"]


def test_the_seeds_odd_vocabulary_splits_over_tp():
    assert model_config("gpt-seed").vocab_size == 50257
    for tp in (2, 4, 8):
        assert tp_problems(model_config("gpt-seed"), tp) == []


def parallelize_tiny_rank(group, overrides):
    parallelize_gpt(build_seeded_model("gpt-tiny", overrides, SEED), group)


def test_parallelize_gpt_refuses_a_model_that_does_not_divide():
    with pytest.raises(ValueError, match=r"n_head \(4\) must be divisible by tp \(8\)"):
        run(parallelize_tiny_rank, 8, args=({},))


def sequence_parallel_forward_rank(group, length):
    model = parallelize_gpt(build_seeded_model("gpt-tiny", {}, SEED), group, sequence_parallel=True)
    return model(torch.zeros(2, length, dtype=torch.long)).shape


def test_sequence_parallel_needs_a_sequence_divisible_by_tp():
    assert run(sequence_parallel_forward_rank, 2, args=(6,))[0] == (2, 6, 128)
    with pytest.raises(ValueError, match=r"shape \(2, 7, 64\) must be divisible by the tensor-parallel size 2"):
        run(sequence_parallel_forward_rank, 2, args=(7,))

"""Context parallelism on whole models (parallel/context/apply.py): our GPT (learned positions)
and Llama (rotary positions, grouped-query attention) on cp ranks, each holding part of every
sequence, give the one-process loss and gradients. fp64, so that a wrong position or a missed
block shows as a difference far above round-off (1e-10 relative)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import paratrain
from paratrain.models import build_model
from paratrain.models.plans import default_plan
from paratrain.parallel.context import shard
from paratrain.parallel.context.apply import ContextError, apply_context_parallel
from paratrain.parallel.plan import PlanError, load_plan

SEQ = 32


def _batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, vocab, (2, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _loss(model, inputs, targets):
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _one_process(model, inputs, targets):
    model = copy.deepcopy(model)
    loss = _loss(model, inputs, targets)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _on_cp_ranks(model, inputs, targets, cp, layout, method):
    """Each rank: its tokens' loss (a mean over them: every rank holds as many), the gradients
    summed over the ranks and divided by cp, the mean of the global loss."""
    def rank(group):
        mine = copy.deepcopy(model)
        apply_context_parallel(mine, load_plan(default_plan(mine)), group, SEQ, layout, method)
        loss = _loss(mine, *(shard(t, 1, group.rank, cp, layout) for t in (inputs, targets)))
        loss.backward()
        total = loss.detach().clone()
        group.all_reduce(total)
        grads = {}
        for name, p in mine.named_parameters():
            group.all_reduce(p.grad)
            grads[name] = p.grad / cp
        return total.item() / cp, grads

    return paratrain.run(rank, cp, launcher="threads")


@pytest.mark.parametrize("name, cp, layout, method", [
    ("gpt-tiny", 2, "zigzag", "ring"), ("gpt-tiny", 4, "contiguous", "allgather"),
    ("llama-tiny", 2, "contiguous", "allgather"), ("llama-tiny", 4, "zigzag", "ring"),
])
def test_a_model_on_cp_ranks_gives_the_one_process_loss_and_gradients(name, cp, layout, method):
    torch.manual_seed(0)
    model = build_model(name, dropout=0.0).double() if name.startswith("gpt") else build_model(name).double()
    inputs, targets = _batch(model.config.vocab_size)
    want_loss, want_grads = _one_process(model, inputs, targets)
    for loss, grads in _on_cp_ranks(model, inputs, targets, cp, layout, method).values():
        assert abs(loss - want_loss) < 1e-10 * abs(want_loss)
        for param, want in want_grads.items():
            assert (grads[param] - want).abs().max() <= 1e-10 * want.abs().max(), param


def test_without_its_positions_a_model_on_cp_ranks_is_wrong():
    """What the position buffers are for: the capture alone (arange of the local length) fails."""
    torch.manual_seed(0)
    model = build_model("llama-tiny").double()
    plan = default_plan(model)
    inputs, targets = _batch(model.config.vocab_size)
    want_loss, _ = _one_process(model, inputs, targets)

    def rank(group):
        mine = copy.deepcopy(model)
        apply_context_parallel(mine, load_plan({**plan, "context_parallel": {"attention": ["layers.*.attn"]}}),
                               group, SEQ, "zigzag", "ring")
        loss = _loss(mine, *(shard(t, 1, group.rank, 2, "zigzag") for t in (inputs, targets))).detach()
        group.all_reduce(loss)
        return loss.item() / 2

    assert all(abs(loss - want_loss) > 1e-6 for loss in paratrain.run(rank, 2, launcher="threads").values())


def test_a_plan_without_context_parallel_and_attention_with_dropout_are_refused_in_one_line():
    model = build_model("gpt-tiny", dropout=0.1)
    with pytest.raises(PlanError, match="no context_parallel section"):
        apply_context_parallel(model, load_plan({"pipeline": {"blocks": "blocks"}}), None, SEQ)
    with pytest.raises(PlanError, match="pattern 'blocks.*.attention' matches no module"):
        apply_context_parallel(model, load_plan({"context_parallel": {"attention": ["blocks.*.attention"]}}), None, SEQ)
    with pytest.raises(PlanError, match="must name the attention modules"):
        load_plan({"context_parallel": {"attention": []}})

    def rank(group):
        mine = copy.deepcopy(model)
        apply_context_parallel(mine, load_plan(default_plan(mine)), group, SEQ)
        with pytest.raises(ContextError, match="blocks.0.attn: attention dropout \\(0.1\\) is not supported"):
            mine(torch.zeros(1, SEQ // 2, dtype=torch.long))
        return True

    assert all(paratrain.run(rank, 2, launcher="threads").values())

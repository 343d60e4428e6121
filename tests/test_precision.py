"""bf16 and activation checkpointing reach every layout, and bf16 runs match a bf16 reference.

Tolerances (paratrain/train/check.py): losses within 1e-3 relative of the bf16 single-process
reference (measured ~2e-5), and the loss decrease over the run within 5% of the reference's.
A halved gradient moves the decrease by ~25% and fails; that is checked here too, so the
tolerance cannot quietly grow loose again.
"""

from __future__ import annotations

import functools

import pytest
import torch

from paratrain import run
from paratrain.models import GPT
from paratrain.train.check import BF16_LOSS_RTOL, BF16_PARAM_ATOL, BF16_PROGRESS_RTOL, compare
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.reference import Reference, reference_run

LAYOUTS = [
    pytest.param(2, {}, id="dp2"),
    pytest.param(2, {"parallel.tp": 2}, id="tp2"),
    pytest.param(2, {"parallel.pp": 2, "parallel.schedule": "gpipe"}, id="pp2-gpipe"),
    pytest.param(2, {"parallel.pp": 2, "parallel.schedule": "1f1b"}, id="pp2-1f1b"),
    pytest.param(2, {"parallel.pp": 2, "parallel.schedule": "interleaved-1f1b", "parallel.virtual_stages": 2},
                 id="pp2-interleaved"),
    pytest.param(2, {"parallel.pp": 2, "parallel.schedule": "zb-h1"}, id="pp2-zb-h1"),
    pytest.param(2, {"parallel.pp": 2, "parallel.schedule": "zb-v", "parallel.virtual_stages": 2}, id="pp2-zb-v"),
    pytest.param(4, {"parallel.pp": 2, "parallel.tp": 2, "parallel.schedule": "1f1b"}, id="pp2xtp2"),
]


def bf16_config(**overrides) -> TrainConfig:
    """SGD, so the size of the gradient shows in the losses (Adam would normalise it away)."""
    base = {"model.name": "gpt-tiny", "model.n_layer": 2, "steps": 6, "log_every": 100,
            "data.global_batch": 16, "optim.name": "sgd", "optim.lr": 0.5, "parallel.precision": "bf16"}
    if overrides.get("parallel.pp", 1) > 1:
        base["parallel.microbatches"] = 4
    return apply_overrides(TrainConfig(), {**base, **overrides})


def train_and_return_state(group, config):
    return train_rank(group, config, return_state=True)


@functools.lru_cache(maxsize=4)
def bf16_reference(lr: float):
    return reference_run(bf16_config(**{"optim.lr": lr}))


@pytest.mark.parametrize("world, overrides", LAYOUTS)
def test_bf16_matches_the_bf16_reference_in_every_layout(world, overrides):
    config = bf16_config(**overrides)
    report = compare(config, run(train_and_return_state, world, args=(config,)), bf16_reference(0.5))
    assert not report["missing"]
    assert report["max_loss_diff"] <= BF16_LOSS_RTOL, report["loss_diffs"]
    assert report["progress_diff"] <= BF16_PROGRESS_RTOL, report["progress_diff"]
    assert report["max_param_diff"] <= BF16_PARAM_ATOL, (report["worst_param"], report["max_param_diff"])
    # the loss is computed in fp32 under autocast: not rounded to bf16's 1/128 steps near 5.5
    assert any(abs(loss * 128 - round(loss * 128)) > 1e-3 for loss in report["losses"]), report["losses"]


def test_a_halved_gradient_fails_the_bf16_tolerance():
    config = bf16_config()
    halved_lr = reference_run(bf16_config(**{"optim.lr": 0.25}))  # SGD: the same as a halved gradient
    as_results = {0: {"log": [{"loss": loss} for loss in halved_lr.losses], "state": halved_lr.state}}
    report = compare(config, as_results, bf16_reference(0.5))
    assert report["progress_diff"] > 3 * BF16_PROGRESS_RTOL


def _model_recorder(monkeypatch):
    """Patch model building in the loop to record each GPT's head output dtype and how often
    its blocks' attention runs (recomputation runs it again inside backward)."""
    import paratrain.train.loop as loop

    seen = {"head_dtypes": set(), "attention_calls": 0}

    def instrument(model):
        if isinstance(model, GPT):
            model.head.register_forward_hook(lambda m, i, out: seen["head_dtypes"].add(out.dtype))
            for block in model.blocks:
                block.attn.register_forward_hook(lambda m, i, out: seen.__setitem__("attention_calls", seen["attention_calls"] + 1))
        return model

    # after tensor parallelism has replaced the head: instrument the model the loop trains (every
    # layout builds it through build_parallel_model)
    build_parallel = loop.build_parallel_model

    def build_and_instrument(*args, **kwargs):
        parallel = build_parallel(*args, **kwargs)
        instrument(parallel.model)
        return parallel

    monkeypatch.setattr(loop, "build_parallel_model", build_and_instrument)
    return seen


@pytest.mark.parametrize("world, overrides", [
    pytest.param(2, {}, id="dp2"), pytest.param(2, {"parallel.tp": 2}, id="tp2"),
    pytest.param(2, {"parallel.pp": 2, "parallel.microbatches": 2}, id="pp2"),
])
def test_bf16_and_recompute_reach_every_layout(monkeypatch, world, overrides):
    """Both flags were once given only to the pipeline runtime: at pp = 1 they did nothing."""
    seen = _model_recorder(monkeypatch)
    plain = apply_overrides(bf16_config(**overrides), {"steps": 1, "parallel.precision": "fp32"})
    run(train_rank, world, args=(plain,))
    assert seen["head_dtypes"] == {torch.float32}
    calls_without = seen["attention_calls"]

    seen.update(head_dtypes=set(), attention_calls=0)
    both = apply_overrides(bf16_config(**overrides), {"steps": 1, "parallel.checkpoint_activations": True})
    run(train_rank, world, args=(both,))
    assert seen["head_dtypes"] == {torch.bfloat16}
    assert seen["attention_calls"] == 2 * calls_without  # every block recomputed once in backward


def test_compare_looks_at_every_rank_not_only_the_last():
    """`check` once merged the ranks' states with dict.update: only the last replica counted."""
    reference_state = {"w": torch.zeros(3)}
    results = {0: {"log": [{"loss": 1.0}, {"loss": 0.5}], "state": {"w": torch.ones(3)}},  # wrong
               1: {"log": [{"loss": 1.0}, {"loss": 0.5}], "state": {"w": torch.zeros(3)}}}
    report = compare(bf16_config(), results, Reference([1.0, 0.5], reference_state, []))
    assert report["max_param_diff"] == 1.0 and report["worst_param"] == "w (rank 0)"

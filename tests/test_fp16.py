"""--precision fp16: autocast in fp16 with dynamic loss scaling, against PyTorch's own
(torch.amp.GradScaler) on one process, by the bf16 rule (paratrain/train/check.py).

At the default scale (2^16) these steps never overflow, and every layout matches. Where the
scale overflows, every rank must skip the same step, whoever overflowed: a rank that stepped
alone would leave its replica behind and its collectives out of step.
"""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.parallel.data import build_data_parallel
from paratrain.parallel.precision import LossScaler
from paratrain.train.check import compare, passes, tolerances
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from tests.test_data_parallel import reference_for


def fp16_config(**overrides) -> TrainConfig:
    base = {"model.name": "gpt-tiny", "steps": 4, "log_every": 100, "data.global_batch": 16,
            "optim.lr": 0.5, "parallel.precision": "fp16"}
    return apply_overrides(TrainConfig(), {**base, **overrides})


def train_and_return_state(group, config):
    return train_rank(group, config, return_state=True)


def checked(config, world):
    return compare(config, paratrain.run(train_and_return_state, world, args=(config,)), reference_for(config))


@pytest.mark.parametrize("world, overrides", [
    pytest.param(2, {}, id="ddp"),
    pytest.param(2, {"parallel.zero": 3}, id="zero3"),
    pytest.param(4, {"parallel.tp": 2, "parallel.pp": 2, "parallel.microbatches": 2}, id="tp2-pp2"),
])
def test_fp16_matches_gradscaler_on_one_process(world, overrides):
    config = fp16_config(**overrides)
    report = checked(config, world)
    assert report["skipped_steps"] == report["reference_skipped_steps"] == 0
    assert passes(report, tolerances(config)), report
    assert report["max_param_diff"] > 0  # fp16 is not fp32: the comparison sees its rounding


def test_overflowed_steps_are_skipped_as_gradscaler_skips_them():
    """2^24: the first five steps overflow (the scale halves each time), the sixth trains."""
    config = fp16_config(**{"steps": 6, "parallel.loss_scale": 2.0**24, "parallel.zero": 2})
    results = paratrain.run(train_and_return_state, 2, args=(config,))
    report = compare(config, results, reference_for(config))
    assert report["skipped_steps"] == report["reference_skipped_steps"] == 5
    assert passes(report, tolerances(config))
    summary = results[0]["summary"]
    assert summary["skipped_steps"] == 5 and summary["loss_scale"] == 2.0**19


def _one_rank_overflows(group):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    dp = build_data_parallel(model, group, zero=2)
    model(torch.randn(4, 8)).sum().backward()
    dp.finish_gradients()
    if group.rank == 1:  # its shard alone overflowed
        dp.gradients_to_scale()[0][0] = float("inf")
    scaler = LossScaler(init_scale=4.0)
    before = dp.shard.grad.clone()
    stepped = scaler.unscale(dp, group)
    scaler.update(stepped)
    return stepped, scaler.scale, scaler.skipped, torch.equal(before, dp.shard.grad)


def test_one_ranks_overflow_skips_the_step_on_every_rank():
    results = paratrain.run(_one_rank_overflows, 2)
    assert results == {0: (False, 2.0, 1, True), 1: (False, 2.0, 1, True)}  # none divided, all halved


def test_the_scale_doubles_after_its_growth_interval_without_overflow():
    scaler = LossScaler(init_scale=8.0, growth_interval=3)
    for _ in range(3):
        scaler.update(stepped=True)
    assert scaler.scale == 16.0
    scaler.update(stepped=False)
    assert scaler.scale == 8.0 and scaler.skipped == 1

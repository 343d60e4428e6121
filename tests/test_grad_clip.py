"""--clip-grad-norm: the global norm over every shard, equal to torch.nn.utils.clip_grad_norm_ on
one process, in the layouts where an element is easiest to count twice or not at all.

The norms before clipping are compared step by step (1e-5 relative), besides the usual losses
and parameters: a tensor-parallel replica counted twice moves the norm by ~2e-4 here, too
little to move the parameters beyond 1e-5 in a few steps. Every run's clip binds (the limit is a
quarter of the norm), so the scaling is exercised, not only the measurement.
"""

from __future__ import annotations

import pytest
import torch

from paratrain import run
from paratrain.comm.ops import part_bounds
from paratrain.parallel.data.base import pieces_of_shard
from paratrain.train.check import FP32_LOSS_RTOL, FP32_PARAM_ATOL, compare, passes, tolerances
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.validate import problems_with
from tests.test_data_parallel import reference_for

LIMIT = 0.1  # llama-tiny's gradient norm is ~0.44 in these steps: every step is clipped

LAYOUTS = [
    pytest.param(8, {"parallel.tp": 2, "parallel.pp": 2, "parallel.microbatches": 4}, id="tp2-pp2-dp2"),
    pytest.param(4, {"parallel.tp": 2, "parallel.zero": 3}, id="zero3-tp2"),
    pytest.param(2, {"parallel.pp": 2, "parallel.schedule": "zb-v", "parallel.virtual_stages": 2,
                     "parallel.microbatches": 4}, id="pp2-zb-v"),
    pytest.param(4, {"parallel.tp": 2, "parallel.zero": 2, "parallel.sequence_parallel": True}, id="zero2-tp2-sp"),
]


def clip_config(**overrides) -> TrainConfig:
    base = {"model.name": "llama-tiny", "steps": 2, "log_every": 100, "data.global_batch": 16,
            "optim.clip_grad_norm": LIMIT}
    return apply_overrides(TrainConfig(), {**base, **overrides})


def train_and_return_state(group, config):
    return train_rank(group, config, return_state=True)


@pytest.mark.parametrize("world, overrides", LAYOUTS)
def test_the_clipped_run_matches_torchs_clip_grad_norm_on_one_process(world, overrides):
    config = clip_config(**overrides)
    report = compare(config, run(train_and_return_state, world, args=(config,)), reference_for(config))
    assert len(report["grad_norms"]) == config.steps
    assert min(report["grad_norms"]) > 2 * LIMIT  # the clip binds
    assert report["max_grad_norm_diff"] <= FP32_LOSS_RTOL, (report["grad_norms"], report["reference_grad_norms"])
    assert report["max_param_diff"] <= FP32_PARAM_ATOL, (report["worst_param"], report["max_param_diff"])
    assert passes(report, tolerances(config))


def test_a_norm_counted_wrong_fails_the_check():
    """The check's own sensitivity: a run whose norms are off by 1e-4 fails, however close its
    parameters."""
    config = clip_config()
    reference = reference_for(config)
    off = {0: {"log": [{"loss": loss, "grad_norm": norm * (1 + 1e-4)}
                       for loss, norm in zip(reference.losses, reference.grad_norms)], "state": reference.state}}
    report = compare(config, off, reference)
    assert report["max_param_diff"] == 0.0 and not passes(report, tolerances(config))


@pytest.mark.parametrize("sizes, world", [([5, 3, 8], 3), ([1, 1], 4), ([7], 2), ([4, 9, 2, 6], 5)])
def test_shards_pieces_cover_every_gradient_element_once(sizes, world):
    """However a flat buffer of parameters is cut into ranks' spans, each element of each
    gradient is in exactly one rank's pieces, the same element."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    flat = torch.arange(sum(sizes), dtype=torch.float32)
    total = flat.numel()
    seen = [torch.zeros(n) for n in sizes]
    for rank in range(world):
        start, end = part_bounds(total, world)[rank]
        shard = flat[start:end]
        for param, piece in pieces_of_shard(params, [(start, end, 0)], shard):
            index = next(i for i, p in enumerate(params) if p is param)
            first = int(piece[0].item()) - sum(sizes[:index]) if piece.numel() else 0
            seen[index][first : first + piece.numel()] += 1
            assert torch.equal(piece, flat[sum(sizes[:index]) + first : sum(sizes[:index]) + first + piece.numel()])
    assert all(torch.equal(count, torch.ones_like(count)) for count in seen)


def test_a_negative_limit_is_one_line_before_any_rank_starts():
    problems = problems_with(clip_config(**{"optim.clip_grad_norm": -1.0}), 2)
    assert problems == ["optim.clip_grad_norm must be a finite number >= 0, got -1.0"]

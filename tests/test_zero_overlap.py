"""ZeRO-1 with bucketed reduce-scatters that start during backward.

Each bucket is sharded on its own (this rank owns part `rank` of every bucket), so the layout
of the optimizer's shard changes with the bucket size. Parity with the single-process
reference, the overlap itself, and checkpoints (which store whole tensors and must not depend
on that layout) are checked with buckets small enough that the mlp has many of them.
"""

from __future__ import annotations

import pytest
import torch

from paratrain import run
from paratrain.parallel.data.zero import ZeroOneDataParallel
from paratrain.train.loop import train_rank
from tests.test_checkpoint import interrupted_and_resumed, losses_of, merged_state
from tests.test_data_parallel import assert_matches_reference, make_config

SMALL_BUCKETS = {"parallel.bucket_mb": 0.01, "parallel.first_bucket_mb": 0.001}  # the mlp: ~10 buckets
ADAMW = {"optim.name": "adamw", "optim.lr": 0.01, "optim.weight_decay": 0.1}
BATCH = {"data.global_batch": 48}  # divides among 2, 3 and 4 ranks


@pytest.mark.parametrize("world_size", [2, 3, 4])  # 3: parts of unequal size in every bucket
def test_zero_one_with_many_buckets_matches_single_process(world_size):
    assert_matches_reference(make_config(**{"parallel.zero": 1, **SMALL_BUCKETS, **ADAMW, **BATCH}), world_size)


def test_zero_one_with_gradient_accumulation_matches_single_process():
    config = make_config(**{"parallel.zero": 1, "parallel.grad_accum": 2, **SMALL_BUCKETS, **ADAMW, **BATCH})
    assert_matches_reference(config, 2)


def test_reduce_scatters_start_during_backward(monkeypatch):
    """Before, every reduce-scatter ran in finish_gradients, after backward had ended."""
    started_early, buckets, original = [], [], ZeroOneDataParallel.finish_gradients

    def recorded(self):
        started_early.append(self.reductions.started)
        buckets.append(len(self._ranges))
        return original(self)

    monkeypatch.setattr(ZeroOneDataParallel, "finish_gradients", recorded)
    run(train_rank, 2, args=(make_config(**{"parallel.zero": 1, "steps": 2, **SMALL_BUCKETS}),))
    assert min(buckets) > 2, buckets
    # Backward produces the last bucket's gradients last: all but that one are in flight.
    assert all(started >= count - 1 for started, count in zip(started_early, buckets)), (started_early, buckets)


def _shard_layout(group):
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    zero = ZeroOneDataParallel(model, group, bucket_mb=40 / (1 << 20), first_bucket_mb=40 / (1 << 20))
    flat = torch.arange(zero.flat_params.numel(), dtype=torch.float32)
    mine = zero.own_part(flat)
    return mine, zero.gather_shards(mine), flat, len(zero._ranges)


def test_a_rank_owns_its_part_of_every_bucket_and_gathering_the_shards_gives_everything():
    results = run(_shard_layout, 3)
    flat, buckets = results[0][2], results[0][3]
    assert buckets > 1
    owned = torch.cat([mine for mine, _, _, _ in results.values()])
    assert sorted(owned.tolist()) == flat.tolist()  # every element owned once
    for mine, gathered, _, _ in results.values():
        assert torch.equal(gathered, flat)


def test_resume_with_many_buckets_gives_the_uninterrupted_losses_bit_for_bit(tmp_path):
    whole, resumed = interrupted_and_resumed(tmp_path, 2, **{"parallel.zero": 1, **SMALL_BUCKETS, **ADAMW, **BATCH})
    assert losses_of(resumed) == losses_of(whole)[3:]
    for name, value in merged_state(whole).items():
        assert torch.equal(merged_state(resumed)[name], value), name


def test_a_zero_checkpoint_loads_into_another_world_and_bucket_size(tmp_path):
    """Saved by 2 ranks with many buckets, resumed by 3 with one bucket: another shard layout."""
    whole, resumed = interrupted_and_resumed(
        tmp_path, 2, resume_world=3, resume_overrides={"parallel.bucket_mb": 25.0, "parallel.first_bucket_mb": 1.0},
        **{"parallel.zero": 1, **SMALL_BUCKETS, **ADAMW, **BATCH})
    assert losses_of(resumed) == pytest.approx(losses_of(whole)[3:], rel=1e-6)

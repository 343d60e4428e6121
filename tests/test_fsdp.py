"""ZeRO-2 and ZeRO-3 / FSDP: parity with the single-process reference, and what each rank holds.

Tolerances are those of test_data_parallel (fp32: losses 1e-5 relative, parameters 1e-5
absolute): sharding changes only the order in which per-rank gradients are summed. The GPT
runs use SGD: AdamW at lr 1e-2 divides by the square root of tiny second moments, which turns
that ~1e-7 reordering into ~4e-5 on a few biases for every data-parallel mode, DDP included.
"""

from __future__ import annotations

import pytest
import torch

from paratrain import run
from paratrain.parallel.data import build_data_parallel
from paratrain.parallel.data.fsdp import FullyShardedDataParallel
from paratrain.train.check import BF16_LOSS_RTOL, BF16_PARAM_ATOL, BF16_PROGRESS_RTOL, compare
from paratrain.train.config import ConfigError
from paratrain.train.loop import train_rank
from paratrain.train.memory import estimate
from paratrain.train.validate import validate
from tests.test_checkpoint import (RESHARD_ATOL, RESHARD_RTOL, RESUMED_FROM, SHORT_RUN, interrupted_and_resumed,
                                   losses_of, merged_state)
from tests.test_data_parallel import (assert_matches_reference, assert_results_match_reference, make_config,
                                      reference_for, train_and_return_state, train_each_and_return_state)
from tests.test_parallel_3d import assert_same_as_one_process

ADAMW = {"optim.name": "adamw", "optim.lr": 0.01, "optim.weight_decay": 0.1}
# 2 steps: the second step's loss is a forward through the weights the first update wrote.
MODELS = {
    "mlp": {"model.name": "mlp", "data.global_batch": 48, "steps": 2, **ADAMW},
    "cnn": {"model.name": "cnn", "model.channels": (8, 16), "model.hidden": 32, "data.global_batch": 48, "steps": 2},
    "gpt-tiny": {"model.name": "gpt-tiny", "data.global_batch": 12, "steps": 2},
}
SMALL_BUCKETS = {"parallel.bucket_mb": 0.01, "parallel.first_bucket_mb": 0.001}  # several buckets in flight


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("model", list(MODELS))
def test_zero_two_matches_single_process(model, world_size):
    assert_matches_reference(make_config(**{"parallel.zero": 2, **SMALL_BUCKETS, **MODELS[model]}), world_size)


ZERO3_OPTIONS = {
    "default": {},
    "no-reshard": {"parallel.reshard_after_forward": False},
    "no-prefetch": {"parallel.prefetch": 0},
    "prefetch-2-no-reshard": {"parallel.prefetch": 2, "parallel.reshard_after_forward": False},
}
ZERO3_WORLDS = (2, 3, 4)  # 3 ranks: no unit of these models divides evenly by 3
# Each model under each option set once, on a world turned by both (the i-th model under the j-th
# options runs on world (i + j) mod 3): every model and every option set meets every world, uneven
# parts included, each pair at least once, in 12 runs instead of the whole product's 36.
ZERO3 = [
    pytest.param(model, options, world, id=f"{name}-{model}-{world}")
    for j, (name, options) in enumerate(ZERO3_OPTIONS.items())
    for i, model in enumerate(MODELS)
    for world in [ZERO3_WORLDS[(i + j) % len(ZERO3_WORLDS)]]
]


@pytest.mark.parametrize("model, overrides, world_size", ZERO3)
def test_zero_three_matches_single_process(model, overrides, world_size):
    assert_matches_reference(make_config(**{"parallel.zero": 3, **MODELS[model], **overrides}), world_size)


def test_zero_two_with_gradient_accumulation_matches_single_process():
    """Gradients of the micro-batches that do not communicate stay whole until the last one's."""
    config = make_config(**{"parallel.zero": 2, "parallel.grad_accum": 2, **SMALL_BUCKETS, **MODELS["mlp"]})
    assert_matches_reference(config, 2)


def test_fsdp_mode_with_gradient_accumulation_and_recompute_matches_single_process():
    config = make_config(**{"parallel.dp_mode": "fsdp", "parallel.grad_accum": 2,
                            "parallel.checkpoint_activations": True, **MODELS["gpt-tiny"]})
    assert_matches_reference(config, 2)


# FSDP over the data axis of the mesh: each tensor-parallel shard of a unit is sharded again over
# dp; each pipeline stage's units over its dp group, gathered for every microbatch's forward and
# backward (with resharding on: memory over fewer collectives, as FSDP2 does by default).
WITH_TP_AND_PP = [
    pytest.param({"parallel.tp": 2}, id="tp2"),
    pytest.param({"parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.microbatches": 2}, id="pp2-1f1b"),
    pytest.param({"parallel.pp": 2, "parallel.schedule": "zb-h1", "parallel.microbatches": 4}, id="pp2-zb-h1"),
]


@pytest.mark.parametrize("overrides", WITH_TP_AND_PP)
def test_fsdp_with_tensor_or_pipeline_parallelism_matches_single_process(overrides):
    config = make_config(**{"parallel.zero": 3, **MODELS["gpt-tiny"], "data.global_batch": 8, **overrides})
    assert_same_as_one_process(config, 4)


def _gathered_during_a_step(group, prefetch, reshard):
    """How many units are gathered at each unit's forward and backward, and after the step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(5)])
    dp = build_data_parallel(model, group, mode="fsdp", prefetch=prefetch, reshard_after_forward=reshard)
    seen = []
    for layer in model:
        layer.register_forward_pre_hook(lambda *_: seen.append(sum(u.is_gathered for u in dp.units)))
    dp.module(torch.ones(2, 6)).sum().backward()
    dp.finish_gradients()
    at_rest = sum(u.is_gathered for u in dp.units)
    shard_sizes = [u.shard.numel() for u in dp.units]
    dp.close()
    return seen, at_rest, shard_sizes, [p.grad is None for p in model.parameters()]


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_a_unit_is_gathered_only_around_its_use(prefetch):
    results = run(_gathered_during_a_step, 3, args=(prefetch, True))
    seen, at_rest, shard_sizes, grads_dropped = results[0]
    # At a unit's forward: the units before it are freed; it and `prefetch` more are coming.
    assert max(seen) <= 1 + prefetch, seen
    assert at_rest == 0 and all(grads_dropped)
    # 42 elements per unit over 3 ranks: parts 14 each; the world's shards add up to the unit.
    assert sum(results[r][2][0] for r in results) == 42


class _RecordedWait:
    """A collective's handle whose wait is written down, as (`wait`, unit)."""

    def __init__(self, handle, unit: int, events: list):
        self._handle, self._unit, self._events = handle, unit, events

    def wait(self):
        self._events.append(("wait", self._unit))
        return self._handle.wait()

    def __getattr__(self, name):
        return getattr(self._handle, name)


def _gathers_and_waits(group, prefetch):
    """The order in which a step starts each unit's all-gather and waits for it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(5)])
    dp = build_data_parallel(model, group, mode="fsdp", prefetch=prefetch)
    events, all_gather = [], dp.gather_group.all_gather
    unit_of = {id(unit.full): unit.index for unit in dp.units}

    def recorded(output, input, algo="auto", async_op=False):
        events.append(("start", unit_of[id(output)]))
        return _RecordedWait(all_gather(output, input, algo, async_op=async_op), unit_of[id(output)], events)

    dp.gather_group.all_gather = recorded
    dp.module(torch.ones(2, 6)).sum().backward()
    dp.finish_gradients()
    dp.close()
    return events


def _started_before_waited(events, wait_of, nxt):
    """Units k whose wait (at `wait_of[k]` in `events`) was preceded, since k's own gather started,
    by the start of the next unit's (in forward k + 1, in backward k - 1)."""
    ahead = set()
    for k, at in wait_of.items():
        own_start = max(i for i in range(at) if events[i] == ("start", k))
        if nxt(k) is not None and ("start", nxt(k)) in events[own_start + 1:at]:
            ahead.add(k)
    return ahead


@pytest.mark.parametrize("prefetch", [0, 1])
def test_prefetch_starts_the_next_units_gather_before_this_units_wait(prefetch):
    events = run(_gathers_and_waits, 2, args=(prefetch,))[0]
    waits = [(i, e[1]) for i, e in enumerate(events) if e[0] == "wait"]
    forward = {}
    for index, unit in waits:  # each unit's first wait is its forward's
        forward.setdefault(unit, index)
    backward = {unit: index for index, unit in waits if index != forward[unit]}  # its second, before backward
    units = len(forward)
    ahead_in_forward = _started_before_waited(events, forward, lambda k: k + 1 if k + 1 < units else None)
    ahead_in_backward = _started_before_waited(events, backward, lambda k: k - 1 if k > 0 else None)
    if prefetch:  # every unit but the last (forward) and the first (backward) had the next one coming
        assert ahead_in_forward == set(range(units - 1)), events
        assert ahead_in_backward == {k for k in backward if k > 0}, events
    else:  # nothing starts early: the recording sees the difference
        assert not ahead_in_forward and not ahead_in_backward, events


def test_without_resharding_every_unit_stays_gathered_until_its_backward():
    seen, at_rest, _, _ = run(_gathered_during_a_step, 2, args=(0, False))[0]
    assert seen == [1, 2, 3, 4, 5] and at_rest == 0


def test_zero_two_keeps_no_whole_gradient():
    def step(group):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
        dp = build_data_parallel(model, group, zero=2, bucket_mb=1e-4, first_bucket_mb=1e-4)
        dp.module(torch.ones(2, 8)).sum().backward()
        dp.finish_gradients()
        return [p.grad for p in model.parameters()], dp.shard.grad.numel(), dp.flat_grads

    grads, shard, flat_grads = run(step, 2)[0]
    assert all(g is None for g in grads) and flat_grads is None
    assert shard == pytest.approx((8 * 8 + 8 + 8 * 3 + 3) / 2, abs=len(grads))


def test_reduce_scatters_start_during_backward(monkeypatch):
    started_early, original = [], FullyShardedDataParallel.finish_gradients

    def recorded(self):
        started_early.append((self.reductions.started, len(self.units)))
        return original(self)

    monkeypatch.setattr(FullyShardedDataParallel, "finish_gradients", recorded)
    run(train_rank, 2, args=(make_config(**{"parallel.zero": 3, **MODELS["gpt-tiny"]}),))
    # Backward ends with the embeddings: every other unit's reduce-scatter is already in flight.
    assert all(started >= units - 1 for started, units in started_early), started_early


@pytest.mark.parametrize("overrides, message", [
    ({"parallel.zero": 4}, "--zero must be 0, 1"),
    ({"parallel.dp_mode": "fsdp", "parallel.zero": 1}, "--dp-mode fsdp shards optimizer state, gradients and parameters and --zero 1"),
    ({"parallel.dp_mode": "torch-fsdp"}, "needs a default process group"),
    ({"parallel.zero": 3, "parallel.prefetch": -1}, "parallel.prefetch"),
    ({"parallel.dp_mode": "torch-fsdp", "parallel.launcher": "processes", "model.name": "gpt-tiny",
      "parallel.tp": 2}, "torch-fsdp works with data parallelism alone"),
])
def test_bad_sharding_options_are_named(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(make_config(**overrides), 4)
    assert message in str(error.value)


# One world of 2 processes (gloo) trains both, one after the other: start-up costs seconds.
ON_PROCESSES = {
    "fsdp": make_config(**{"parallel.zero": 3, "parallel.launcher": "processes", **MODELS["gpt-tiny"]}),
    "torch-fsdp": make_config(**{"parallel.dp_mode": "torch-fsdp", "parallel.launcher": "processes",
                                 **MODELS["gpt-tiny"]}),
    # FSDP2's MixedPrecisionPolicy, as ours: bf16 gathers and reduce-scatters, fp32 shards
    "torch-fsdp-bf16": make_config(**{"parallel.dp_mode": "torch-fsdp", "parallel.launcher": "processes",
                                      "parallel.precision": "bf16", **MODELS["gpt-tiny"]}),
}


def test_ours_and_pytorch_fsdp2_match_single_process_on_processes():
    by_rank = run(train_each_and_return_state, 2, launcher="processes", args=(ON_PROCESSES,))
    for name, config in ON_PROCESSES.items():
        results = {rank: result[name] for rank, result in by_rank.items()}
        if config.parallel.precision == "bf16":
            report = compare(config, results, reference_for(config))
            assert report["max_loss_diff"] <= BF16_LOSS_RTOL and report["max_param_diff"] <= BF16_PARAM_ATOL, report
        else:
            assert_results_match_reference(config, results)


def _memory(world_size, **overrides):
    config = make_config(**{**MODELS["gpt-tiny"], **ADAMW, "optim.lr": 1e-3, "steps": 2, **overrides})
    memory = run(train_rank, world_size, args=(config,))[0]["summary"]["memory"]
    # --plan-only's prediction, from the configuration alone, agrees with what was measured
    # (to within uneven parts and AdamW's 4-byte step counts).
    (predicted,) = estimate(config, world_size)
    for key, value in (("params_bytes", predicted.weights), ("grads_bytes", predicted.grads),
                       ("optimizer_bytes", predicted.optimizer)):
        assert max(memory[key]) == pytest.approx(value, rel=2e-3), (key, overrides)
    return memory


def held_at_rest(memory):
    """The most any rank holds between steps: parameters, gradients and optimizer state."""
    return max(sum(row) for row in zip(memory["params_bytes"], memory["grads_bytes"], memory["optimizer_bytes"]))


def test_held_memory_per_rank_shrinks_with_each_zero_stage():
    """Measured from the tensors held, on every rank: ZeRO-1 shards the optimizer state, ZeRO-2
    the gradients too, ZeRO-3 the parameters too (1/4 each on 4 ranks, to within uneven parts)."""
    ddp, zero1, zero2, zero3 = (_memory(4, **{"parallel.zero": z, **SMALL_BUCKETS}) for z in (0, 1, 2, 3))
    for memory in (ddp, zero1, zero2, zero3):
        assert set(memory) == {"params_bytes", "grads_bytes", "optimizer_bytes", "peak_bytes", "activations_bytes"}
        assert all(len(values) == 4 for values in memory.values())
    # AdamW: two moments per parameter, and a 4-byte step count per tensor
    assert max(ddp["optimizer_bytes"]) == pytest.approx(2 * max(ddp["params_bytes"]), rel=1e-3)
    assert max(zero1["optimizer_bytes"]) <= 0.26 * max(ddp["optimizer_bytes"])
    assert max(zero2["grads_bytes"]) <= 0.26 * max(ddp["grads_bytes"])
    assert held_at_rest(zero3) <= 0.26 * held_at_rest(ddp)
    # At its peak ZeRO-3 holds gathered units besides its shards: on gpt-tiny, whose root unit
    # (embeddings and head, gathered through the step) is a quarter of the model, about as much as
    # ZeRO-2's whole parameters; both stay well below DDP's.
    assert max(zero3["peak_bytes"]) < 0.65 * max(ddp["peak_bytes"])
    assert max(zero2["peak_bytes"]) < 0.6 * max(ddp["peak_bytes"])


# Checkpoints hold whole tensors under the single-device names, whatever the sharding: FSDP
# gathers each unit's parameters and optimizer state to save, and keeps its own part on load.
GPT_ADAMW = {"model.name": "gpt-tiny", "optim.name": "adamw", "optim.lr": 1e-3, "data.global_batch": 8, **SHORT_RUN}


@pytest.mark.parametrize("world, overrides", [
    pytest.param(2, {"parallel.zero": 3, **GPT_ADAMW}, id="fsdp2"),
    pytest.param(2, {"parallel.zero": 2, **GPT_ADAMW}, id="zero2"),
    pytest.param(4, {"parallel.zero": 3, "parallel.tp": 2, **GPT_ADAMW}, id="tp2xfsdp2"),
])
def test_a_sharded_run_resumes_bit_for_bit(tmp_path, world, overrides):
    whole, resumed = interrupted_and_resumed(tmp_path, world, **overrides)
    assert losses_of(resumed) == losses_of(whole)[RESUMED_FROM:]
    for name, value in merged_state(whole).items():
        assert torch.equal(merged_state(resumed)[name], value), name


@pytest.mark.parametrize("saved, world, resumed_as, resumed_world", [
    pytest.param({"parallel.zero": 3}, 4, {}, 2, id="fsdp4-to-fsdp2"),
    pytest.param({"parallel.zero": 3}, 2, {"parallel.zero": 0}, 2, id="fsdp-to-ddp"),
    pytest.param({"parallel.zero": 3, "parallel.tp": 2}, 4, {"parallel.zero": 0, "parallel.tp": 1}, 2,
                 id="tp2xfsdp2-to-tp1"),
])
def test_a_sharded_checkpoint_loads_into_another_layout(tmp_path, saved, world, resumed_as, resumed_world):
    whole, resumed = interrupted_and_resumed(
        tmp_path, world, resume_overrides=resumed_as, resume_world=resumed_world, **{**GPT_ADAMW, **saved})
    assert losses_of(resumed) == pytest.approx(losses_of(whole)[RESUMED_FROM:], rel=RESHARD_RTOL)
    for name, value in merged_state(whole).items():
        assert torch.allclose(merged_state(resumed)[name], value, rtol=0, atol=RESHARD_ATOL), name


def test_bf16_fsdp_stays_close_to_the_bf16_reference():
    """bf16 gathers and reduce-scatters, fp32 master shards: `paratrain check`'s bf16 rule (losses
    1e-3 relative, parameters 1e-3 absolute, the loss decrease 5e-2 relative)."""
    config = make_config(**{"parallel.zero": 3, "parallel.precision": "bf16", **MODELS["gpt-tiny"], "steps": 4})
    report = compare(config, run(train_and_return_state, 2, args=(config,)), reference_for(config))
    assert report["max_loss_diff"] <= BF16_LOSS_RTOL and report["max_param_diff"] <= BF16_PARAM_ATOL, report
    assert report["progress_diff"] <= BF16_PROGRESS_RTOL, report


def _bf16_unit(group):
    dp = build_data_parallel(torch.nn.Sequential(torch.nn.Linear(4, 4)), group, mode="fsdp", precision="bf16")
    with dp.gathered():
        whole = dp.module[0].weight.dtype
    dp.module(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
    dp.finish_gradients()
    return dp.units[0].full.dtype, whole, dp.units[0].shard.dtype, dp.units[0].shard.grad.dtype


def test_bf16_fsdp_gathers_bf16_and_keeps_fp32_master_shards():
    assert run(_bf16_unit, 2)[0] == (torch.bfloat16, torch.float32, torch.float32, torch.float32)


def test_zero_three_on_an_8_block_llama_gathers_a_block_at_a_time():
    """llama-tiny with 8 blocks (each about 1/9 of the model, as in llama-small), 4 ranks, AdamW:
    a quarter of DDP's memory at rest, and during the step the shards plus a few gathered units,
    far from the whole model's parameters and gradients."""
    def held(zero):
        config = make_config(**{"model.name": "llama-tiny", "model.n_layer": 8, **ADAMW, "optim.lr": 1e-3, "steps": 2,
                                "data.global_batch": 8, "parallel.zero": zero})
        return run(train_rank, 4, args=(config,))[0]["summary"]["memory"]

    ddp, zero3 = held(0), held(3)
    assert held_at_rest(zero3) <= 0.3 * held_at_rest(ddp)
    assert max(zero3["peak_bytes"]) < max(ddp["peak_bytes"])
    whole = max(ddp["params_bytes"]) + max(ddp["grads_bytes"])  # what one unit of the whole model would gather
    assert max(zero3["peak_bytes"]) - held_at_rest(zero3) < 0.5 * whole

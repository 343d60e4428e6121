"""Parity of tensor, pipeline and 3D parallelism with the single-process reference.

Each configuration trains 2 steps of a GPT on the threads launcher (8 ranks or fewer) and is
compared with the plain one-process loop on the same weights and global batches (fp32, SGD
with momentum): the second step's loss is a forward through the weights the first update wrote,
and the parameters compared have taken both updates. Tolerances: losses within 1e-5 relative;
parameters within 1e-6 absolute.
Sharding and pipelining only change the order of floating-point sums (measured: losses
~1e-7 relative, parameters ~1e-8). Adam is avoided here on purpose: it divides by the root of
tiny second moments, which turns 1e-9 gradient noise into lr-sized parameter noise.
"""

from __future__ import annotations

import functools

import pytest

from paratrain import run
from paratrain.train.check import compare
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from tests.test_data_parallel import reference_for

LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-6

# (dp, pp, tp, schedule, microbatches, extra parallel options). Every schedule runs at pp 2 and
# pp 4 (where middle stages both receive and send), beside data parallelism and with activation
# checkpointing; tp 2 and 4, sequence parallelism with and without the pipeline. A layout whose
# parts all meet in another is not repeated: tp 2 alone is in dp 2 x tp 2, tp 4 alone in pp 2 x tp 4,
# dp 2 x pp 2 under 1F1B and ZB-H1 in the 3D layouts, pp 4 under 1F1B in the seed's layout below,
# and pp 2 under plain 1F1B in the processes-launcher test.
CONFIGS = [
    (2, 1, 2, None, 1, {}),
    (1, 1, 2, None, 1, {"sequence_parallel": True}),
    (1, 2, 1, "gpipe", 2, {}),
    (1, 2, 1, "interleaved-1f1b", 4, {"virtual_stages": 2}),
    (1, 4, 1, "interleaved-1f1b", 8, {"virtual_stages": 2}),
    (1, 2, 1, "zb-h1", 4, {}),
    (1, 4, 1, "zb-h1", 8, {}),
    (1, 2, 1, "zb-v", 4, {}),
    (1, 4, 1, "zb-v", 8, {}),
    (2, 2, 1, "zb-v", 4, {}),
    (2, 2, 1, "interleaved-1f1b", 2, {"virtual_stages": 2, "dp_mode": "naive"}),
    (2, 2, 2, "1f1b", 4, {}),
    (1, 2, 4, "gpipe", 2, {}),
    (1, 2, 1, "1f1b", 4, {"checkpoint_activations": True}),
    (1, 2, 2, "zb-v", 4, {"checkpoint_activations": True}),
    (2, 2, 2, "zb-h1", 4, {"checkpoint_activations": True}),
    (1, 2, 2, "1f1b", 4, {"sequence_parallel": True}),
]


def config_for(dp, pp, tp, schedule, microbatches, extra) -> TrainConfig:
    # Pipeline layers = blocks + embedding + head: one per chunk at least (4 stages x 2 chunks
    # need 6 blocks); fewer blocks otherwise, since each costs time and proves nothing more.
    chunks = pp * (2 if schedule == "zb-v" else extra.get("virtual_stages", 1))
    overrides = {
        "model.name": "gpt-tiny", "model.n_layer": max(2, chunks - 2), "steps": 2, "log_every": 100,
        "data.global_batch": 16, "optim.name": "sgd", "optim.lr": 0.1, "parallel.pp": pp, "parallel.tp": tp,
        "parallel.microbatches": microbatches, **{f"parallel.{k}": v for k, v in extra.items()},
    }
    if schedule:
        overrides["parallel.schedule"] = schedule
    return apply_overrides(TrainConfig(), overrides)


def assert_same_as_one_process(config: TrainConfig, world: int) -> None:
    results = run(functools.partial(train_rank, return_state=True), world, args=(config,))
    report = compare(config, results, reference_for(config))
    assert not report["missing"], f"parameters no rank reported: {report['missing']}"
    assert report["max_loss_diff"] <= LOSS_RTOL, report["loss_diffs"]
    assert report["max_param_diff"] <= PARAM_ATOL, (report["worst_param"], report["max_param_diff"])


@pytest.mark.parametrize(
    "dp, pp, tp, schedule, microbatches, extra", CONFIGS,
    ids=[f"dp{c[0]}-pp{c[1]}-tp{c[2]}-{c[3] or 'none'}-m{c[4]}" + "".join(f"-{k}" for k in c[5]) for c in CONFIGS],
)
def test_parallel_gpt_trains_like_one_process(dp, pp, tp, schedule, microbatches, extra):
    assert_same_as_one_process(config_for(dp, pp, tp, schedule, microbatches, extra), dp * pp * tp)


def test_the_seeds_layout_tp2_pp4_1f1b_matches_one_process():
    """The GT seed's demo layout, tp 2 x pp 4 under 1F1B with 4 microbatches, on gpt-tiny (one
    pipeline layer per stage). The 8-layer gpt-small preset trains in this layout in
    test_frontend_demo.py, there against the frontend and one process."""
    assert_same_as_one_process(config_for(1, 4, 2, "1f1b", 4, {}), 8)


def test_pipeline_reports_its_measured_and_theoretical_bubble():
    result = run(train_rank, 2, args=(config_for(1, 2, 1, "1f1b", 4, {}),))[0]
    assert result["summary"]["theoretical_bubble"] == pytest.approx(1 / 5)
    assert all(0 <= entry["bubble"] < 1 for entry in result["log"])


def test_pipeline_with_processes_matches_one_process():
    config = config_for(1, 2, 1, "1f1b", 4, {})
    results = run(functools.partial(train_rank, return_state=True), 2, launcher="processes", args=(config,))
    report = compare(config, results, reference_for(config))
    assert report["max_loss_diff"] <= LOSS_RTOL and report["max_param_diff"] <= PARAM_ATOL


def test_bf16_autocast_pipeline_stays_close_to_the_bf16_reference():
    """bf16 keeps ~3 significant digits, so the tolerance is check's bf16 one (2e-2), not fp32's."""
    config = config_for(1, 2, 2, "zb-h1", 4, {"precision": "bf16"})
    results = run(functools.partial(train_rank, return_state=True), 4, args=(config,))
    report = compare(config, results, reference_for(config))
    assert report["max_loss_diff"] <= 2e-2 and report["max_param_diff"] <= 2e-2, report


def test_no_rank_trains_before_every_rank_has_its_weights(monkeypatch):
    """Threads-launcher ranks share torch's global RNG, which activation checkpointing saves
    and restores around each recompute: a replica that trained while another rank was still
    drawing its initial weights gave that rank other weights (a CI run saw losses 4e-4 off).
    Here the last rank builds its model late; no rank may start a step before it is done."""
    import time
    import paratrain.train.loop as loop

    events, build = [], loop.build_parallel_model

    def slow_build(config, mesh, dataset):
        model = build(config, mesh, dataset)
        if mesh.coords.dp == 1 and mesh.coords.pp == 1 and mesh.coords.tp == 1:
            time.sleep(0.5)  # a rank still initialising (on a busy machine, the lock's last)
        events.append(("built", time.perf_counter()))
        return model

    from paratrain.parallel.pipeline.runtime import PipelineRuntime

    run_step = PipelineRuntime.run

    def recorded_run(self, inputs, targets):
        events.append(("step", time.perf_counter()))
        return run_step(self, inputs, targets)

    monkeypatch.setattr(loop, "build_parallel_model", slow_build)
    monkeypatch.setattr(PipelineRuntime, "run", recorded_run)
    config = apply_overrides(config_for(2, 2, 2, "zb-h1", 4, {"checkpoint_activations": True}), {"steps": 1})
    run(functools.partial(train_rank), 8, args=(config,))
    last_built = max(t for kind, t in events if kind == "built")
    first_step = min(t for kind, t in events if kind == "step")
    assert sum(kind == "built" for kind, _ in events) == 8
    assert first_step > last_built, f"a rank stepped {last_built - first_step:.3f} s before the last rank was built"


@pytest.mark.parametrize("schedule, pp, microbatches, extra", [
    ("zb-v", 2, 8, {"virtual_stages": 2}), ("zb-v", 4, 8, {"virtual_stages": 2}), ("zb-h1", 2, 8, {}),
    ("1f1b", 2, 8, {"checkpoint_activations": True}),
])
def test_the_pipeline_holds_no_more_than_its_schedule_says(monkeypatch, schedule, pp, microbatches, extra):
    """ZB-V once kept every microbatch's V-turn input until the step ended (8 of 8 on the last
    rank): each rank must end a step holding nothing, and hold at most 2p chunk activations
    (ZB-V's 2p half-size chunks, 1F1B's p whole ones)."""
    from paratrain.parallel.pipeline.runtime import PipelineRuntime

    stats, original = [], PipelineRuntime.run

    def recorded(self, inputs, targets):
        result = original(self, inputs, targets)
        stats.append(result)
        return result

    monkeypatch.setattr(PipelineRuntime, "run", recorded)
    config = apply_overrides(config_for(1, pp, 1, schedule, microbatches, extra), {"steps": 1})
    run(train_rank, pp, args=(config,))
    assert len(stats) == pp and all(s["left_stashed"] == 0 for s in stats), [s["left_stashed"] for s in stats]
    assert max(s["peak_stashed"] for s in stats) <= 2 * pp, [s["peak_stashed"] for s in stats]


@pytest.mark.parametrize("schedule, extra", [("zb-h1", {}), ("zb-v", {"virtual_stages": 2}), ("1f1b", {})])
def test_ddp_overlaps_communication_under_every_schedule(monkeypatch, schedule, extra):
    """Zero-bubble W passes write .grad by hand, so autograd's hooks never told our DDP a
    gradient was ready and every bucket started in finish_gradients. Some must start before."""
    from paratrain.parallel.data.ddp import BucketedDataParallel

    started_early, original = [], BucketedDataParallel.finish_gradients

    def recorded(self):
        started_early.append(self.reductions.started)
        return original(self)

    monkeypatch.setattr(BucketedDataParallel, "finish_gradients", recorded)
    config = apply_overrides(config_for(2, 2, 1, schedule, 4, {**extra, "bucket_mb": 0.01, "first_bucket_mb": 0.001}),
                             {"steps": 1})
    run(train_rank, 4, args=(config,))
    assert len(started_early) == 4 and all(n > 0 for n in started_early), started_early

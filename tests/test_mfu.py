"""MFU in the training summary: model FLOPs counted on the meta device equal the planner's
formula where it has one, and every model gets a count (the CNN and a user's file too)."""

from __future__ import annotations

import pytest

import paratrain
from paratrain.plan.cli import build_shape
from paratrain.plan.flops import step_flops
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.mfu import model_flops_per_step, utilization
from paratrain.train.setup import build_seeded_model, dataset_for
from paratrain.train.validate import problems_with

OWN_MODEL = "examples/own_model/model.py:build"


@pytest.mark.parametrize("model, overrides, shape_overrides", [
    ("gpt-small", {}, {}),
    ("gpt-tiny", {"n_layer": 3}, {"layers": 3}),
    ("llama-tiny", {}, {}),
    ("llama-small", {"n_layer": 2}, {"layers": 2}),
])
def test_counted_flops_equal_the_planners_formula(model, overrides, shape_overrides):
    dataset = dataset_for(model, overrides, None, 0)
    counted = model_flops_per_step(model, overrides, dataset, 16)
    assert counted == pytest.approx(step_flops(build_shape(model, shape_overrides), 16), rel=1e-9)


@pytest.mark.parametrize("model", ["cnn", "mlp", OWN_MODEL])
def test_models_without_a_formula_are_counted_too(model):
    dataset = dataset_for(model, {}, None, 0)
    small, large = (model_flops_per_step(model, {}, dataset, batch) for batch in (8, 16))
    assert small > 0 and large == pytest.approx(2 * small)  # linear in the batch


def test_a_preset_is_counted_once_per_shape_and_a_users_file_every_time(monkeypatch):
    """The count is kept for our presets (keyed by model, overrides and batch shape), not for a
    user's file, which may change between two runs of one process."""
    import paratrain.train.mfu as mfu

    monkeypatch.setattr(mfu, "_KEPT_COUNTS", {})
    built = []

    def build_and_note(model_name, *args, **kwargs):
        built.append(model_name)
        return build_seeded_model(model_name, *args, **kwargs)

    monkeypatch.setattr(mfu, "build_seeded_model", build_and_note)
    gpt = dataset_for("gpt-tiny", {}, None, 0)
    first = model_flops_per_step("gpt-tiny", {}, gpt, 16)
    assert model_flops_per_step("gpt-tiny", {}, gpt, 16) == first and built == ["gpt-tiny"]
    assert model_flops_per_step("gpt-tiny", {}, gpt, 8) == pytest.approx(first / 2)  # another shape
    assert model_flops_per_step("gpt-tiny", {"n_layer": 3}, gpt, 16) > first  # other overrides
    own = dataset_for(OWN_MODEL, {}, None, 0)
    counts = [model_flops_per_step(OWN_MODEL, {}, own, 8) for _ in range(2)]
    assert counts[0] == counts[1] and built == ["gpt-tiny"] * 3 + [OWN_MODEL] * 2


def test_utilization_is_flops_over_time_ranks_and_peak():
    result = utilization(flops_per_step=8e12, step_ms=2000.0, ranks=4, peak_tflops=2.0)
    assert result["tflops_per_rank"] == pytest.approx(1.0) and result["mfu"] == pytest.approx(0.5)
    assert "mfu" not in utilization(8e12, 2000.0, 4, None)


def test_the_summary_reports_mfu_against_the_peak_given():
    config = apply_overrides(TrainConfig(), {"model.name": "gpt-tiny", "steps": 2, "log_every": 100,
                                             "data.global_batch": 8, "peak_tflops": 0.5})
    summary = paratrain.run(train_rank, 2, args=(config,))[0]["summary"]
    expected = model_flops_per_step("gpt-tiny", {}, dataset_for("gpt-tiny", {}, None, 0), 8)
    assert summary["model_flops_per_step"] == expected
    assert summary["mfu"] == pytest.approx(expected / (summary["step_ms"] / 1e3) / 2 / 0.5e12)


def test_a_peak_that_is_not_positive_is_one_line():
    config = apply_overrides(TrainConfig(), {"peak_tflops": 0.0})
    assert problems_with(config, 2) == ["peak_tflops must be a finite number > 0 (TFLOP/s per device), got 0.0"]

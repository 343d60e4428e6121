"""`paratrain model fit` and the validation's measuring: fits that recover what made the data,
a written profile that reads back with a source on every value, every validation case valid."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.plan.calibrate import layer_features, nonnegative_least_squares
from paratrain.plan.cost_model import layer_passes
from paratrain.plan.fit import chosen_fits, fit_alpha_beta, fit_records
from paratrain.plan.fit_cli import PARATRAIN_CPU
from paratrain.plan.hardware import load_profile
from paratrain.plan.memory import Layout
from paratrain.plan.shapes import GPTShape
from paratrain.plan.validate import CASES, train_config


def test_alpha_beta_fit_recovers_the_line_that_made_the_points():
    sizes = [1 << k for k in range(10, 24, 2)]
    fitted, error = fit_alpha_beta([(s, 50e-6 + s / 2e9) for s in sizes])
    assert fitted.alpha_us == pytest.approx(50, rel=1e-6) and fitted.gbps == pytest.approx(2, rel=1e-6)
    assert error < 1e-9


def _collective(op, algo, nbytes, alpha_us, gbps, world=2):
    return {"op": op, "algo": algo, "launcher": "processes", "world_size": world, "bytes": nbytes,
            "time_us": alpha_us + nbytes / gbps / 1e3, "wrong": 0}


def test_auto_rows_fit_together_and_are_what_the_profile_keeps():
    sizes = [1 << k for k in range(12, 22, 2)]
    records = [(_collective("all_reduce", "native", s, 100, 1.0), "c.json") for s in sizes]
    records += [(_collective("all_reduce", "auto(ring)" if s > 1 << 16 else "auto(native)", s, 80, 2.0), "c.json")
                for s in sizes]
    fits = fit_records(records)
    assert {f.key[3] for f in fits} == {"native", "auto"}
    chosen = chosen_fits(fits)["all_reduce/2"]
    assert chosen.key[3] == "auto" and chosen.fitted.gbps == pytest.approx(2.0)


def test_model_fit_writes_a_profile_with_a_source_on_every_value(tmp_path):
    sizes = [1 << k for k in range(10, 22, 2)]
    collectives = [_collective(op, "auto(native)", s, 200, 1.5) for op in ("all_reduce", "all_gather") for s in sizes]
    p2p = [{"test": "uni", "src": a, "dst": 1 - a, "bytes": s, "time_us": 2 * 60 + s / 2e3, "gbps": 1.0,
            "launcher": "processes", "transport": "gloo", "world_size": 2} for a in (0, 1) for s in sizes]
    (tmp_path / "c.json").write_text(json.dumps(collectives))
    (tmp_path / "p.json").write_text(json.dumps(p2p))
    out = tmp_path / "host.yaml"
    result = CliRunner().invoke(main, ["model", "fit", str(tmp_path / "c.json"), str(tmp_path / "p.json"),
                                       "--no-compute", "--base", "a100-80gb-hdr", "--name", "host", "-o", str(out)])
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    assert profile.name == "host" and profile.fitted("all_gather", 2).gbps == pytest.approx(1.5)
    assert profile.intra_node.latency_us == pytest.approx(60, rel=0.05)  # half the 120 us round: the ack's
    for line in out.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
            assert "#" in line, line


def test_nonnegative_least_squares_keeps_coefficients_at_or_above_zero():
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert np.allclose(nonnegative_least_squares(a, a @ np.array([2.0, 0.5])), [2.0, 0.5])
    x = nonnegative_least_squares(a, np.array([3.0, 2.0, 1.0]))  # falling: the slope would be negative
    assert np.all(x >= 0) and x[1] == 0


def test_calibration_features_are_the_cost_models_own_counts():
    """Pricing each class at its fitted rate through the features gives the cost model's time."""
    profile = load_profile("cpu-2core")
    shape = GPTShape(layers=1, hidden=128, heads=2, seq=64, vocab=256)
    features = layer_features(shape, 4, profile.software)
    c = profile.compute
    rates = [1 / c.matmul_flops, 1 / c.attention_flops, 1 / c.memory_bytes_per_s, c.op_overhead_us * 1e-6]
    passes = layer_passes(shape, Layout(micro_batch=4), profile)
    assert np.dot(features, rates) == pytest.approx(sum(p.compute for p in passes.values()), rel=1e-9)


def test_every_validation_case_is_a_training_configuration_paratrain_accepts():
    """...and the one the prediction is for: same ranks, same sequences per microbatch."""
    assert len(CASES) >= 8
    for case in CASES:
        config = train_config(case, steps=3)  # raises ConfigError if paratrain would refuse it
        layout, par = case.layout, config.parallel
        assert (par.nproc, par.tp, par.pp, par.zero) == (layout.gpus, layout.tp, layout.pp, layout.zero)
        per_replica = config.data.global_batch // layout.dp
        assert per_replica // (par.microbatches if layout.pp > 1 else 1) == layout.micro_batch
    assert load_profile("cpu-2core").software == PARATRAIN_CPU

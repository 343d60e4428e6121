"""`paratrain bench pipeline`: bad input is refused before launching; a tiny run reports both
implementations with the ratio and bubble columns."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from paratrain.cli import main


def test_bench_pipeline_rejects_bad_input_before_launching():
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "pipeline", "--schedules", "1f1b,bogus"])
    assert result.exit_code == 2 and "unknown schedule(s) bogus" in result.output
    result = runner.invoke(main, ["bench", "pipeline", "--nproc", "1"])
    assert result.exit_code == 2 and "at least 2 stages" in result.output
    result = runner.invoke(main, ["bench", "pipeline", "--global-batch", "30", "--microbatches", "8"])
    assert result.exit_code == 2 and "not divisible by 8 microbatches" in result.output
    for flag in ("--microbatches", "--steps", "--global-batch"):  # once a crash inside the ranks
        result = runner.invoke(main, ["bench", "pipeline", flag, "0"])
        assert result.exit_code == 2 and "0 is not in the range x>=1" in result.output, result.output


def test_bench_pipeline_compares_ours_with_torch_pipelining(tmp_path):
    out = tmp_path / "pp.json"
    result = CliRunner().invoke(main, [
        "bench", "pipeline", "--model", "gpt-tiny", "--schedules", "1f1b,zb-h1", "--microbatches", "2",
        "--global-batch", "4", "--steps", "1", "--warmup", "0", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    assert {(r["impl"], r["schedule"]) for r in records} == {
        ("paratrain", "1f1b"), ("torch.pipelining", "1f1b"), ("paratrain", "zb-h1")}
    ours = next(r for r in records if r["impl"] == "paratrain" and r["schedule"] == "1f1b")
    assert ours["ratio_to_torch"] > 0 and 0 <= ours["bubble_measured"] < 1
    # one timed step: its median and mean are that step's
    assert ours["bubble_measured_mean"] == pytest.approx(ours["bubble_measured"])
    assert ours["step_ms_mean"] == pytest.approx(ours["step_ms"])
    assert "medians over 1 timed step (the measured bubble's mean beside it)" in result.output
    assert ours["bubble_theoretical"] == 1 / 3  # (p-1)/(m+p-1) with p=2, m=2
    assert 0 <= ours["bubble_simulated"] < 1
    assert ours["bubble_theoretical_costs"] == pytest.approx(1 / 3)  # 1F1B's does not depend on F:B


def test_the_simulated_bubble_is_the_theoretical_one_for_equal_stages_and_grows_with_imbalance():
    import torch

    from paratrain.bench.pipeline import _simulated_bubble
    from paratrain.parallel.pipeline.simulate import theoretical_bubble

    equal = torch.tensor([[1.0, 2.0, 0.0]] * 4)  # per stage: F, B, W seconds
    assert _simulated_bubble("1f1b", 4, 8, equal) == pytest.approx(theoretical_bubble("1f1b", 4, 8))
    lopsided = equal.clone()
    lopsided[3] *= 1.5  # the last stage (the head and loss) 50% slower
    assert _simulated_bubble("1f1b", 4, 8, lopsided) > theoretical_bubble("1f1b", 4, 8) + 0.05


def test_theory_at_the_models_own_costs_moves_only_the_zero_bubble_schedules():
    """Equal stages at a measured F:B:W: GPipe's and 1F1B's bubbles are the textbook ones
    whatever the ratio; ZB-H1's is (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W)) (Qi et al. 2023),
    the unit-cost figure only when F = B = W."""
    import torch

    from paratrain.bench.pipeline import _balanced_bubble
    from paratrain.parallel.pipeline.simulate import theoretical_bubble

    p, m = 2, 8
    uneven = torch.tensor([[0.9, 1.1, 0.0], [1.1, 1.3, 0.0]])  # per stage F, B, W; means 1.0, 1.2
    for name in ("gpipe", "1f1b"):
        assert _balanced_bubble(name, p, m, uneven) == pytest.approx(theoretical_bubble(name, p, m))
    assert _balanced_bubble("zb-h1", p, m, torch.ones(p, 3)) == pytest.approx(theoretical_bubble("zb-h1", p, m))
    f, b, w = 9.5, 11.25, 7.05  # ms: gpt-small's means on the 2-core machine
    costs = torch.tensor([[f, b, w]] * p)
    idle = (p - 1) * (f + b - w)
    assert _balanced_bubble("zb-h1", p, m, costs) == pytest.approx(idle / (m * (f + b + w) + idle))

"""`paratrain bench moe`: its rows and JSON, and that the three ways it times compute the same
thing."""

import json

import torch
from click.testing import CliRunner

from paratrain.bench.moe import moe, padded_experts, uneven_counts
from paratrain.models.moe_experts import GroupedExperts


def test_bench_moe_times_each_method_at_each_expert_count_and_writes_json(tmp_path):
    out = tmp_path / "moe.json"
    result = CliRunner().invoke(moe, ["--experts", "2", "--experts", "4", "--tokens", "32", "--d-model", "8",
                                      "--d-expert", "16", "--repeats", "1", "--warmup", "0", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [(r["experts"], r["method"]) for r in rows] == [(e, m) for e in (2, 4) for m in ("grouped", "loop", "padded")]
    assert all(r["rows"] == 64 and r["median_ms"] > 0 for r in rows)
    assert "loop / this" in result.output and "load average" in result.output


def test_the_grouped_loop_and_padded_experts_agree():
    torch.manual_seed(0)
    experts = GroupedExperts(8, 16, 5)
    for weight in experts.parameters():
        torch.nn.init.normal_(weight, std=0.3)
    counts_e = uneven_counts(5, 40, 0.5)
    tokens_SD = torch.randn(40, 8)
    loop = experts.compute_loop(tokens_SD, counts_e)
    torch.testing.assert_close(experts.compute_grouped(tokens_SD, counts_e), loop, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded_experts(experts, tokens_SD, counts_e), loop, rtol=1e-5, atol=1e-6)


def test_a_width_grouped_mm_cannot_take_is_refused_in_one_line():
    result = CliRunner().invoke(moe, ["--d-model", "6", "--experts", "2", "--tokens", "8", "--repeats", "1"])
    assert result.exit_code == 2 and "each must be a multiple of 4" in result.output

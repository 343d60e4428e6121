"""`paratrain bench moe`: its rows and JSON, and that the three ways it times compute the same
thing; with --ep, expert parallelism's rows per token as the routing decided them."""

import json
from collections import Counter

import pytest
import torch
from click.testing import CliRunner

from paratrain.bench import moe_ep
from paratrain.bench.moe import moe, padded_experts, uneven_counts
from paratrain.models.moe import moe_layers
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


def test_uniform_rows_per_token_counts_the_ranks_k_distinct_experts_land_on():
    assert moe_ep.uniform_rows_per_token(8, 2, 1) == 1
    assert moe_ep.uniform_rows_per_token(8, 2, 2) == pytest.approx(11 / 7)  # 1.571: 21% under 2 rows
    assert moe_ep.uniform_rows_per_token(8, 2, 8) == pytest.approx(2)  # one expert per rank: k ranks


def _routed_rows(monkeypatch) -> Counter:
    """Rows each rank's tokens need by the routers' own decisions, (ep, rank) -> rows: one per
    token and ep rank holding one of its kept choices (a forward hook on every router)."""
    needed, started = Counter(), moe_ep.start

    def start_watching_routers(group, config):
        trainer = started(group, config)
        layers, ep = moe_layers(trainer.job.module), config.parallel.ep
        local = layers[0].n_experts // ep

        def count(router, args, routing):
            ranks_BTK = torch.where(routing.kept_BTK, routing.experts_BTK // local, -1)
            needed[(ep, group.rank)] += sum(len(set(token) - {-1}) for token in ranks_BTK.flatten(0, 1).tolist())
        for layer in layers:
            layer.router.register_forward_hook(count)
        return trainer

    monkeypatch.setattr(moe_ep, "start", start_watching_routers)
    return needed


def test_bench_moe_ep_counts_the_rows_the_routing_needs_and_writes_json(tmp_path, monkeypatch):
    needed, out = _routed_rows(monkeypatch), tmp_path / "moe-ep.json"
    result = CliRunner().invoke(moe, ["--ep", "1,2", "--nproc", "2", "--steps", "3", "--launcher", "threads",
                                      "--global-batch", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert [r["ep"] for r in record["rows"]] == [1, 2] and record["rows"][0]["vs_ep1"] == 1
    for key in ("step_ms", "exposed_ms", "ep_comm_ms", "tokens_per_s", "vs_ep1", "rows_per_token",
                "uniform_rows_per_token", "saving", "bytes_to_others_per_rank_step", "expert_imbalance",
                "ep_rank_imbalance"):
        assert all(key in r for r in record["rows"]), key
    dispatched = [s for s in record["steps"] if s["ep"] == 2]
    assert len(dispatched) == 2 * 3 and all(s["rows_to"] is None for s in record["steps"] if s["ep"] == 1)
    for rank in (0, 1):  # the dispatchers' splits, summed over steps, are the routers' decisions
        assert sum(sum(s["rows_to"]) for s in dispatched if s["rank"] == rank) == needed[(2, rank)] > 0
    for s in dispatched:
        assert s["rows_to_others"] == sum(s["rows_to"]) - s["rows_to"][s["rank"]]
        assert s["bytes_to_others"] == s["rows_to_others"] * 64 * 4  # moe-tiny's d_model, fp32
        assert s["tokens"] <= sum(s["rows_to"]) <= s["choices"] == 2 * s["tokens"]  # top-2, nothing dropped
    for load in (e for e in record["loads"] if e["ep"] == 2):  # the log's count of choices is the dispatchers'
        assert sum(map(sum, load["expert_tokens"])) - load["dropped_pairs"] == \
            sum(s["choices"] for s in dispatched if (s["round"], s["step"]) == (load["round"], load["step"]))
    row = record["rows"][1]
    assert row["rows_per_token"] == pytest.approx(sum(needed[(2, r)] for r in (0, 1)) / sum(s["tokens"] for s in dispatched))
    assert "rows/token" in result.output and "uniform" in result.output
    page = moe_ep.markdown_lines(record)  # the results page's section
    assert page[2].startswith("| ep | step ms |") and page[-1].startswith(f"| 2 | {row['step_ms']:.1f} |")
    assert f"| {row['rows_per_token']:.3f} | 1.571 |" in page[-1]


def test_bench_moe_refuses_an_option_of_the_other_part():
    result = CliRunner().invoke(moe, ["--ep", "1,2", "--tokens", "8"])
    assert result.exit_code == 2 and "--tokens is for the matmul part" in result.output

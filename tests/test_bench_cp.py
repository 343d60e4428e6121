"""`paratrain bench cp`: its table, the work balance it prints, its JSON and its refusals."""

import json

from click.testing import CliRunner

from paratrain.bench.cp import balance_lines, cp


def test_bench_cp_times_each_row_and_writes_json(tmp_path):
    out = tmp_path / "cp.json"
    result = CliRunner().invoke(cp, ["--cp", "2", "--seq", "64", "--methods", "ring,allgather", "--layouts", "zigzag",
                                     "--steps", "1", "--warmup", "0", "--heads", "4", "--kv-heads", "2",
                                     "--head-dim", "8", "--launcher", "threads", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [(r["cp"], r["seq"], r["method"], r["layout"]) for r in rows] == [(2, 64, "ring", "zigzag"),
                                                                            (2, 64, "allgather", "zigzag")]
    assert all(r["step_ms"] > 0 and 0 <= r["exposed_ms"] <= r["step_ms"] for r in rows)
    assert "largest / mean 1.00" in result.output


def test_the_balance_lines_show_zigzag_even_and_contiguous_175_at_cp_4():
    lines = balance_lines([1, 4], 4096)
    assert lines[1].startswith("  cp 4 zigzag") and lines[1].endswith("largest / mean 1.00")
    assert lines[2].startswith("  cp 4 contiguous") and lines[2].endswith("largest / mean 1.75")


def test_bench_cp_refuses_a_sequence_that_does_not_split_in_one_line():
    result = CliRunner().invoke(cp, ["--cp", "4", "--seq", "100"])
    assert result.exit_code == 2 and "sequence 100 does not divide by 2·cp = 8" in result.output
    result = CliRunner().invoke(cp, ["--methods", "ring,p2p"])
    assert result.exit_code == 2 and "choose from ring, allgather" in result.output

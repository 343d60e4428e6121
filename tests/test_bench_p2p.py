"""`paratrain bench p2p`: every ordered pair measured, matrices filled, slow links named."""

import json

from click.testing import CliRunner

from paratrain.bench.p2p_cli import matrix, slow_links
from paratrain.cli import main


def _record(test, src, dst, gbps, size=1024):
    return {"test": test, "src": src, "dst": dst, "bytes": size, "time_us": size / gbps / 1e3, "gbps": gbps}


def test_p2p_measures_every_ordered_pair_and_writes_json_and_a_heatmap(tmp_path):
    out, png = tmp_path / "p2p.json", tmp_path / "p2p.png"
    result = CliRunner().invoke(main, [
        "bench", "p2p", "--nproc", "3", "--launcher", "threads", "--min-bytes", "64", "--max-bytes", "4K",
        "--factor", "8", "--warmup", "1", "--iters", "3", "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    sizes = {64, 512, 4096}
    assert {r["bytes"] for r in records} == sizes
    uni = {(r["src"], r["dst"], r["bytes"]) for r in records if r["test"] == "uni"}
    assert uni == {(a, b, s) for a in range(3) for b in range(3) if a != b for s in sizes}
    assert len([r for r in records if r["test"] == "bi"]) == 3 * len(sizes)
    assert len([r for r in records if r["test"] == "all_to_all"]) == len(sizes)
    assert all(r["gbps"] > 0 and r["world_size"] == 3 and r["transport"] == "fabric" for r in records)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "unidirectional bandwidth" in result.output and "all-to-all" in result.output


def test_bidirectional_pairs_fill_both_cells_and_the_diagonal_stays_empty():
    values = matrix([_record("bi", 0, 2, 5.0)], "bi", 1024, 3)
    assert values[0][2] == values[2][0] == 5.0
    assert all(values[i][i] is None for i in range(3))


def test_links_below_the_fraction_of_the_median_are_flagged():
    records = [_record("uni", a, b, 10.0) for a in range(4) for b in range(4) if a != b]
    records[5] = _record("uni", records[5]["src"], records[5]["dst"], 3.0)
    flagged = slow_links(records, 1024, 0.8)
    assert [(t, s, d) for t, s, d, _, _ in flagged] == [("uni", records[5]["src"], records[5]["dst"])]
    assert slow_links(records, 1024, 0.2) == []

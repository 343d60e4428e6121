"""`paratrain bench collectives`: its interface (options, JSON keys, errors), tuning, explaining.

Speed is never asserted: these runs are tiny (a few KiB, one or two iterations) and mostly on
threads; one smoke test starts real processes.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import paratrain
from frontend_helpers import run_paratrain
from paratrain.bench import collectives_cli, overhead, tuning
from paratrain.comm.group import Group
from paratrain.bench.collectives import Measurement, bus_factor, element_counts
from paratrain.bench.sweep_plan import ByteSize, sweep_sizes
from paratrain.plan.membw import copy_bandwidth_gbps
from paratrain.bench.report import JSON_KEYS
from paratrain.cli import main
from paratrain.comm.algorithms import ALGORITHMS
from paratrain.comm.choice import AlgorithmTable

TINY = ["--launcher", "threads", "--nproc", "2", "--warmup", "0", "--iters", "1"]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No test reads or writes the user's algorithm table, and none spends time on the
    256 MiB memory-copy measurement (it has its own test)."""
    monkeypatch.setenv("PARATRAIN_ALGO_TABLE", str(tmp_path / "default-table.json"))
    monkeypatch.setattr(collectives_cli, "copy_bandwidth_gbps", lambda device: 12.5)


def bench(*args: str):
    return CliRunner().invoke(main, ["bench", "collectives", *args])


def bench_json(tmp_path, *args: str) -> list[dict]:
    path = tmp_path / "out.json"
    result = bench(*TINY, "--json", str(path), *args)
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text())


def test_help_explains_every_option():
    result = bench("--help")
    assert result.exit_code == 0
    for option in ("--ops", "--algos", "--min-bytes", "--max-bytes", "--factor", "--nproc", "--launcher",
                   "--warmup", "--iters", "--dtype", "--json", "--plot", "--tune", "--explain", "--table",
                   "--timeout", "--debug", "--overhead"):
        assert option in result.output


def test_json_records_have_exactly_the_documented_keys(tmp_path):
    records = bench_json(tmp_path, "--ops", "all_reduce,barrier", "--algos", "ring,native,auto",
                         "--min-bytes", "1K", "--max-bytes", "4K")
    assert len(records) == 3 * 3 + 3  # 3 algorithms x 3 sizes, and the barrier once each
    for record in records:
        assert tuple(record) == JSON_KEYS
        assert record["launcher"] == "threads" and record["world_size"] == 2 and record["wrong"] == 0
        assert record["transport"] == "fabric"
    all_reduce = [r for r in records if r["op"] == "all_reduce"]
    assert [r["bytes"] for r in all_reduce] == [1024] * 3 + [2048] * 3 + [4096] * 3
    assert all(r["count"] == r["bytes"] // 4 for r in all_reduce)
    factor = bus_factor("all_reduce", 2)
    assert all(r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor) for r in all_reduce)
    assert {r["algo"] for r in records} == {"ring", "native", "auto(native)"}  # fabric: native below 64K
    barrier = [r for r in records if r["op"] == "barrier"]
    assert all(r["bytes"] == 0 and r["algbw_gbps"] is None and r["busbw_gbps"] is None for r in barrier)


def test_sizes_are_the_buffers_nccl_tests_reports(tmp_path):
    """all_gather's size is its output, reduce_scatter's its input: the whole array either way."""
    records = bench_json(tmp_path, "--ops", "all_gather,reduce_scatter,all_to_all", "--algos", "native",
                         "--min-bytes", "4K", "--max-bytes", "4K", "--dtype", "bfloat16")
    assert [(r["op"], r["bytes"], r["count"]) for r in records] == [
        ("all_gather", 4096, 2048), ("reduce_scatter", 4096, 2048), ("all_to_all", 4096, 2048),
    ]
    assert all(r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] / 2) for r in records)


def test_table_has_nccl_tests_columns_and_closing_lines():
    result = bench(*TINY, "--ops", "broadcast", "--algos", "tree,native", "--max-bytes", "1K")
    assert result.exit_code == 0, result.output
    out = result.output
    for column in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "vs native"):
        assert column in out
    assert "world size 2  launcher threads  transport fabric" in out
    assert "memory copy bandwidth 12.50 GB/s" in out
    assert "# Avg bus bandwidth    :" in out and "broadcast tree" in out
    assert "# Wrong elements       : 0 OK" in out
    native_row = next(line for line in out.splitlines() if " native " in line and not line.startswith("#"))
    assert native_row.split()[-1] == "1.00x"  # native against itself


def test_auto_lines_judge_the_picks_and_call_the_rest_noise():
    from paratrain.bench.report import auto_lines

    def row(algo, resolved, nbytes, time_us):
        return Measurement("all_reduce", algo, resolved, nbytes, nbytes // 4, "float32", time_us, 1.0, 1.0, 0)

    rows = [row("auto", "hd", 1024, 50.0), row("native", "native", 1024, 100.0),      # picked, 2.00x
            row("auto", "ring", 4096, 125.0), row("native", "native", 4096, 100.0),   # picked, 0.80x
            row("auto", "native", 8192, 90.0), row("native", "native", 8192, 100.0),  # kept, 1.11x
            row("ring", "ring", 8192, 70.0)]
    (line,) = auto_lines(rows)
    assert "ran another algorithm at 2 of 3 sizes, faster than native at 1 of them (0.80x to 2.00x)" in line
    assert "kept native at 1: the same call, so their ratios (1.11x) are this run's noise" in line
    assert auto_lines([row("ring", "ring", 8192, 70.0), row("native", "native", 8192, 100.0)]) == []


def test_explain_prints_auto_choices_without_starting_a_world(monkeypatch):
    monkeypatch.setattr(collectives_cli, "run", lambda *a, **k: pytest.fail("--explain started ranks"))
    result = bench("--explain", "--launcher", "threads", "--ops", "all_reduce,barrier",
                   "--min-bytes", "16K", "--max-bytes", "64K", "--factor", "4")
    assert result.exit_code == 0, result.output
    rows = [line.split(None, 3) for line in result.output.splitlines() if not line.startswith("#")]
    assert [row[:3] for row in rows] == [
        ["all_reduce", "16384", "native"], ["all_reduce", "65536", "ring"], ["barrier", "0", "native"],
    ]
    assert "large message" in rows[1][3]  # default_choice's reason, printed as it is
    assert "transport fabric, world size 2" in result.output


def test_explain_for_processes_names_the_backend(monkeypatch):
    monkeypatch.setattr(collectives_cli.torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("PARATRAIN_SHM", "0")  # gloo's sockets (one host's defaults: test_algorithm_defaults)
    result = bench("--explain", "--launcher", "processes", "--ops", "reduce_scatter", "--min-bytes", "1M",
                   "--max-bytes", "1M")
    assert result.exit_code == 0, result.output
    assert "transport gloo" in result.output and "reduce_scatter" in result.output
    assert "why it can win" not in result.output  # the ring is picked there: nothing to explain


def test_tune_records_native_unless_another_won_and_auto_then_follows_it(tmp_path):
    table_path = tmp_path / "tuned.json"
    measured = bench_json(tmp_path, "--tune", "--table", str(table_path), "--ops", "all_reduce",
                          "--min-bytes", "1K", "--max-bytes", "64K", "--factor", "8")
    assert "auto" not in {r["algo"] for r in measured}  # tuning compares real algorithms only
    table = AlgorithmTable.load(table_path)
    for nbytes in (1024, 8192, 65536):
        times = {r["algo"]: r["time_us"] for r in measured if r["bytes"] == nbytes}
        choice = table.choose("all_reduce", nbytes, 2, "fabric")
        if choice.algo != "native":  # only a clear winner replaces the backend's own
            assert times[choice.algo] < times["native"] * (1 - tuning.MIN_MARGIN)
            assert choice.reason.startswith(f"{choice.algo} took")
        else:
            assert choice.reason.startswith("native")
        assert choice.reason.endswith("on fabric x2")

    followed = bench_json(tmp_path, "--table", str(table_path), "--ops", "all_reduce", "--algos", "auto",
                          "--min-bytes", "1K", "--max-bytes", "64K", "--factor", "8")
    assert [r["algo"] for r in followed] == [
        f"auto({table.choose('all_reduce', n, 2, 'fabric').algo})" for n in (1024, 8192, 65536)
    ]


def _measured(algo: str, bursts: list[float]) -> Measurement:
    median = sorted(bursts)[len(bursts) // 2]
    return Measurement("all_reduce", algo, algo, 4096, 1024, "float32", median, None, None, 0, tuple(bursts))


def test_tuning_keeps_native_when_the_difference_is_within_the_noise():
    native = _measured("native", [100] * 8)
    # faster in 7 of 8 rounds, but by 40% in some and 3% in others: median 0.955x, noise +-18%
    ring = _measured("ring", [60, 62, 95, 96, 97, 60, 98, 130])
    verdict = tuning.judge(native, [ring])
    assert verdict.algo == "native"
    assert "within the noise" in verdict.why


def test_tuning_trusts_a_win_in_every_round_even_when_native_itself_is_noisy():
    native = _measured("native", [300, 4000, 350, 3900, 320, 4100, 310, 3950])  # stalls in half its rounds
    ring = _measured("ring", [200, 600, 210, 580, 205, 620, 190, 610])
    verdict = tuning.judge(native, [ring])
    assert verdict.algo == "ring" and "8/8 rounds" in verdict.why


def test_tuning_keeps_native_when_the_challenger_wins_the_median_but_not_the_rounds():
    native = _measured("native", [100] * 8)
    ring = _measured("ring", [50, 50, 50, 50, 50, 150, 150, 150])  # median 50, wins 5 of 8 rounds
    assert tuning.judge(native, [ring]).algo == "native"


def test_tuning_picks_a_clear_winner_and_says_by_how_much():
    native = _measured("native", [100, 104, 98, 101, 99, 103, 97, 102])
    ring = _measured("ring", [60, 62, 59, 61, 63, 60, 58, 61])
    hd = _measured("hd", [70, 71, 69, 72, 70, 68, 71, 70])
    verdict = tuning.judge(native, [hd, ring])
    assert verdict.algo == "ring"
    assert verdict.why.startswith("ring took 0.6") and "8/8 rounds" in verdict.why


def test_tuning_says_native_was_fastest():
    native = _measured("native", [50] * 4)
    verdict = tuning.judge(native, [_measured("ring", [80] * 4)])
    assert verdict == tuning.Verdict("native", "native fastest: the best other, ring, took 1.60x its time")


def test_overhead_prints_ours_beside_the_bare_replay_per_algorithm_and_size():
    result = bench("--overhead", *TINY, "--algos", "ring,hd,native", "--min-bytes", "4K", "--max-bytes", "16K",
                   "--factor", "4")
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines() if not line.startswith("#")]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("all_reduce", str(size), algo) for size in (4096, 16384) for algo in ("ring", "hd", "native")
    ]
    messages = {(r[1], r[2]): int(r[3]) for r in rows}
    assert messages[("4096", "ring")] == 4 and messages[("4096", "native")] == 0  # 2 ranks: 2 steps
    for row in rows:
        ours, bare, overhead = map(float, row[4:7])
        assert overhead == pytest.approx(ours - bare, abs=0.11)
        burst_ours, burst_bare, burst_ratio = float(row[8]), float(row[9]), float(row[10].rstrip("x"))
        # the times are printed to 0.1 us and the ratio to 0.01: the ratio of the printed times
        # may differ from it by their rounding (a bare burst of 8 us moves it by 0.6%)
        low = (burst_ours - 0.05) / (burst_bare + 0.05) - 0.005
        high = (burst_ours + 0.05) / (burst_bare - 0.05) + 0.005
        assert low <= burst_ratio <= high, (burst_ours, burst_bare, burst_ratio)
        assert float(row[13]) > 0  # paratrain's own call path, against a transport that moves nothing
        assert row[14:] == ["-", "-", "-"]  # no dist.isend/irecv replay on threads
    assert "# largest path: " in result.output


def test_overhead_on_processes_also_times_the_replay_through_dist_isend_irecv():
    result = bench("--overhead", "--launcher", "processes", "--nproc", "2", "--warmup", "0", "--iters", "2",
                   "--algos", "ring,native,oneshot", "--min-bytes", "4K", "--max-bytes", "4K")
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines() if not line.startswith("#")]
    assert [r[2] for r in rows] == ["ring", "native", "oneshot"]
    shared = rows.pop()  # through the shared segment: no transport call, so no bare or dist replay
    assert shared[3] == "0" and shared[5] == shared[6] == shared[7] == shared[14] == "-"
    assert float(shared[4]) > 0 and float(shared[13]) > 0  # ours, and its path in a segment of its own
    for row in rows:
        ours, dist_alone, ratio, dist_cpu = float(row[4]), float(row[14]), float(row[15].rstrip("x")), float(row[16])
        assert dist_alone > 0 and dist_cpu > 0 and ratio == pytest.approx(ours / dist_alone, abs=0.006)
    assert "# our algorithms / the dist.isend/irecv replay, alone: wall " in result.output
    # both ranks share this host: ours and bare through shared memory, dist on gloo's sockets
    assert "transport shm (gloo's processes, every message through shared memory)" in result.output


def null_transport_calls(group) -> tuple[list, float]:
    """What the transport underneath saw while the call-path figure was measured."""
    recorder = overhead.RecordingTransport(group.transport)
    seen = Group(recorder, timeout=group.timeout, table=group.table)
    per_call = overhead.call_path_us(seen, "all_reduce", 4096, torch.float32, torch.device("cpu"), "ring", calls=10)
    return recorder.events, per_call


def test_the_call_path_figure_runs_our_code_but_moves_no_message():
    results = paratrain.run(null_transport_calls, 2)
    for events, per_call in results.values():
        assert events == [] and per_call > 0


def test_overhead_refuses_options_it_does_not_use(monkeypatch):
    monkeypatch.setattr(collectives_cli, "run", lambda *a, **k: pytest.fail("ranks started"))
    result = bench("--overhead", "--tune")
    assert result.exit_code == 2 and "--overhead prints its own table" in result.output


def replay_matches_ours(group, algo: str) -> bool:
    """The bare replay of a recorded call, run on fresh inputs, gives what our call gives."""
    events, (recording, case) = overhead.record_call(group, "all_reduce", 1001, torch.float32, torch.device("cpu"), algo)
    case.reset()
    overhead.bare_replay(events, group.transport, group.timeout)()
    ours = case.inputs[0][1].clone()  # the same input, through our call
    group.all_reduce(ours, algo=algo)
    return torch.equal(case.result, ours) and torch.equal(ours, case.expected)


@pytest.mark.parametrize("algo", ["ring", "hd", "native"])
def test_the_bare_replay_moves_the_same_messages_as_our_call(algo):
    assert paratrain.run(replay_matches_ours, 4, args=(algo,)) == {r: True for r in range(4)}


def public_replays_match_ours(group) -> list[bool]:
    """On gloo, both bare replays (the process group's own calls, dist.isend/irecv) give our sums."""
    seen = []
    for public_api in (False, True):
        events, (recording, case) = overhead.record_call(group, "all_reduce", 1001, torch.float32,
                                                         torch.device("cpu"), "ring")
        case.reset()
        overhead.bare_replay(events, group.transport, group.timeout, public_api=public_api)()
        seen.append(torch.equal(case.result, case.expected))
    return seen


def test_both_bare_replays_on_gloo_give_our_result():
    assert paratrain.run(public_replays_match_ours, 2, launcher="processes") == {0: [True, True], 1: [True, True]}


def test_auto_and_explain_follow_a_given_table(tmp_path):
    table = AlgorithmTable(path=tmp_path / "mine.json")
    table.record("fabric", 2, "all_gather", 4096, "direct")
    table.save()
    records = bench_json(tmp_path, "--table", str(table.path), "--ops", "all_gather", "--algos", "auto",
                         "--min-bytes", "4K", "--max-bytes", "4K")
    assert records[0]["algo"] == "auto(direct)"
    explained = bench("--explain", "--launcher", "threads", "--table", str(table.path), "--ops", "all_gather",
                      "--min-bytes", "4K", "--max-bytes", "4K")
    assert "direct    fastest when measured at 4 KiB on fabric x2" in explained.output


def test_an_algorithm_named_for_several_ops_runs_where_it_exists(tmp_path):
    records = bench_json(tmp_path, "--ops", "all_reduce,reduce_scatter", "--algos", "tree,native",
                         "--min-bytes", "1K", "--max-bytes", "1K")
    assert [(r["op"], r["algo"]) for r in records] == [
        ("all_reduce", "tree"), ("all_reduce", "native"), ("reduce_scatter", "native"),
    ]


def test_wrong_results_are_counted_and_fail_the_run(tmp_path, monkeypatch):
    monkeypatch.setitem(ALGORITHMS["all_reduce"], "ring", lambda link, buf, op: None)  # forgets to reduce
    path = tmp_path / "out.json"
    result = bench(*TINY, "--ops", "all_reduce", "--algos", "ring,native", "--min-bytes", "1K",
                   "--max-bytes", "1K", "--json", str(path))
    assert result.exit_code == 1
    assert "FAILED" in result.output and "wrong elements" in result.output
    wrong = {r["algo"]: r["wrong"] for r in json.loads(path.read_text())}
    assert wrong == {"ring": 2 * 256, "native": 0}  # every element, on both ranks


@pytest.mark.parametrize("args, message", [
    (["--min-bytes", "2K", "--max-bytes", "1K"], "smaller than --min-bytes"),
    (["--factor", "1"], "--factor"),
    (["--factor", "1.5"], "--factor"),
    (["--ops", "all_reduce,allreduce"], "unknown op 'allreduce'"),
    (["--algos", "ring,fast"], "unknown algorithm 'fast'"),
    (["--ops", "reduce_scatter", "--algos", "tree"], "'tree' is not available for reduce_scatter"),
    (["--dtype", "int8"], "--dtype"),
    (["--nproc", "0"], "--nproc"),
    (["--min-bytes", "64Q"], "'64Q' is not a size"),
    (["--max-bytes", "1.5M"], "'1.5M' is not a size"),
    (["--explain", "--json", "x.json"], "--explain alone measures nothing"),
])
def test_bad_input_is_a_usage_error_before_any_rank_starts(monkeypatch, args, message):
    monkeypatch.setattr(collectives_cli, "run", lambda *a, **k: pytest.fail("ranks started on bad input"))
    result = bench(*args)
    assert result.exit_code == 2
    assert message in result.output


def test_an_unreadable_table_is_named(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = bench("--explain", "--table", str(broken))
    assert result.exit_code == 2 and "broken.json is unreadable" in result.output


def test_plot_writes_a_png(tmp_path):
    plot = tmp_path / "busbw.png"
    result = bench(*TINY, "--ops", "all_reduce,all_gather,barrier", "--algos", "direct,native",
                   "--max-bytes", "2K", "--plot", str(plot))
    assert result.exit_code == 0, result.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_processes_launcher_runs_the_sweep_over_gloo(tmp_path):
    path = tmp_path / "out.json"
    done = run_paratrain("bench", "collectives", "--launcher", "processes", "--nproc", "2",
                         "--ops", "all_reduce,all_gather", "--algos", "ring,native", "--min-bytes", "1K",
                         "--max-bytes", "4K", "--factor", "4", "--warmup", "1", "--iters", "2",
                         "--json", str(path), timeout=240)
    assert done.returncode == 0, done.stderr
    assert "transport shm (gloo's processes, every message through shared memory)" in done.stdout  # both ranks on this host
    records = json.loads(path.read_text())
    assert len(records) == 2 * 2 * 2
    assert all(r["launcher"] == "processes" and r["world_size"] == 2 and r["wrong"] == 0 for r in records)


def test_sizes_parse_like_nccl_tests():
    size = ByteSize()
    assert [size.convert(v, None, None) for v in ("100", "64K", "64M", "1G", "4KiB", "8kb")] == [
        100, 64 << 10, 64 << 20, 1 << 30, 4 << 10, 8 << 10,
    ]


def test_sweep_sizes_and_element_counts():
    assert sweep_sizes(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert sweep_sizes(0, 8, 2) == [0, 1, 2, 4, 8]
    # Rounded down to whole elements, at least one, each once; zero only when asked for.
    assert element_counts([0, 1, 2, 4, 8, 10], "float32") == [0, 1, 2]
    assert element_counts([1, 2, 3], "int64") == [1]


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5
    assert [bus_factor(op, 4) for op in ("reduce_scatter", "all_gather", "all_to_all")] == [0.75] * 3
    assert bus_factor("broadcast", 4) == bus_factor("reduce", 4) == 1.0
    assert bus_factor("barrier", 4) is None


def test_copy_bandwidth_is_positive():
    assert copy_bandwidth_gbps("cpu", nbytes=1 << 20, repeats=2) > 0

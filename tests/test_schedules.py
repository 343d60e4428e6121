"""Pipeline schedules checked as data: every list complete and deadlock-free, every dependency
respected in time, bubbles and peak memory as the literature says. No model runs.

Bubble figures use the simulator's unit costs (F = 1, B = 2, or F = B = W = 1 when split,
each divided by the chunks per rank), so the textbook formulas hold exactly, up to float error.
"""

import dataclasses
import json
from functools import lru_cache

import pytest
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    build_schedule,
    dependencies,
    microbatch_problems,
)
from paratrain.parallel.pipeline.simulate import ScheduleDeadlock, simulate, theoretical_bubble
from paratrain.parallel.pipeline.timeline import draw_timeline, format_timeline


def _cases():
    for p in (1, 2, 3, 4, 8):
        for m in sorted({p, p + 1, 2 * p, 3 * p, 4 * p}):
            for name in SCHEDULES:
                if name != "interleaved-1f1b":
                    yield name, p, m, 1
                elif m % p == 0:
                    yield from ((name, p, m, v) for v in (2, 3))


CASES = list(_cases())


def _case_id(case):
    name, p, m, v = case
    return f"{name}-p{p}-m{m}" + (f"-v{v}" if v > 1 else "")


@lru_cache(maxsize=None)
def _built(name, p, m, v=1):
    schedule = build_schedule(name, p, m, v)
    return schedule, simulate(schedule)


def _idle_per_rank(timeline):
    """Bubble time, not fraction: the same busy work waits this long on each rank on average."""
    return timeline.bubble * timeline.makespan


def _cases_of(*names, min_factor=1):
    return [c for c in CASES if c[0] in names and c[2] >= min_factor * c[1]]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_action_runs_once_on_its_chunks_owner(case):
    schedule, _ = _built(*case)
    name, p, m, _ = case
    ops = "FBW" if schedule.split_backward else "FB"
    expected = {Action(op, i, c) for op in ops for i in range(m) for c in range(schedule.num_chunks)}
    listed = [a for rank in schedule.ranks for a in rank]
    assert len(listed) == len(set(listed)) and set(listed) == expected
    for r, rank in enumerate(schedule.ranks):
        assert all(schedule.owner(a.stage) == r for a in rank), f"rank {r} runs another rank's chunk"
    assert schedule.split_backward == (name in ("zb-h1", "zb-v"))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_simulated_timeline_respects_every_dependency(case):
    schedule, timeline = _built(*case)  # simulate raises ScheduleDeadlock if a list cannot finish
    start = {a: s for rank in timeline.ranks for a, s, _ in rank}
    end = {a: e for rank in timeline.ranks for a, _, e in rank}
    for r, rank in enumerate(timeline.ranks):
        assert [a for a, _, _ in rank] == list(schedule.ranks[r]), "ran out of list order"
        for (_, _, previous_end), (_, next_start, _) in zip(rank, rank[1:]):
            assert next_start >= previous_end - 1e-9, f"rank {r} runs two actions at once"
        for action, s, _ in rank:
            for dep in dependencies(action, schedule.num_chunks):
                assert end[dep] <= s + 1e-9, f"{action} started before {dep} ended"
    assert all(start[a] >= 0 for a in start)


def test_chunk_placement_interleaved_round_robin_and_zb_v_in_a_v():
    interleaved, _ = _built("interleaved-1f1b", 4, 8, 3)
    assert [interleaved.chunks_of(r) for r in range(4)] == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    zb_v, _ = _built("zb-v", 4, 8)
    assert zb_v.virtual_stages == 2 and zb_v.num_chunks == 8
    assert [zb_v.chunks_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert zb_v.owner(7) == 0  # the loss sits on rank 0, beside the input
    one, _ = _built("1f1b", 4, 8)
    assert [one.owner(c) for c in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize("case", _cases_of("gpipe", "1f1b"), ids=_case_id)
def test_gpipe_and_1f1b_bubble_is_textbook(case):
    name, p, m, v = case
    assert _built(*case)[1].bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    assert theoretical_bubble(name, p, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("case", _cases_of("interleaved-1f1b"), ids=_case_id)
def test_interleaved_bubble_is_textbook_and_v_times_shorter_than_1f1b(case):
    _, p, m, v = case
    timeline = _built(*case)[1]
    assert timeline.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)
    assert timeline.bubble == pytest.approx(theoretical_bubble("interleaved-1f1b", p, m, v), abs=1e-9)
    if p > 1:
        assert _idle_per_rank(_built("1f1b", p, m)[1]) == pytest.approx(v * _idle_per_rank(timeline))


@pytest.mark.parametrize("case", _cases_of("zb-h1"), ids=_case_id)
def test_zb_h1_bubble_is_a_third_of_1f1b(case):
    _, p, m, _ = case
    zb, one_f_one_b = _built(*case)[1], _built("1f1b", p, m)[1]
    # Bubble time exactly a third: (p-1)(F + B - W) against 1F1B's (p-1)(F + B + W).
    assert _idle_per_rank(zb) == pytest.approx(_idle_per_rank(one_f_one_b) / 3)
    assert zb.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-9)
    if p > 1 and m >= 2 * p:
        # As a fraction of a shorter step it is a bit more than a third: (m+p-1)/(3m+p-1).
        assert 0.2 <= zb.bubble / one_f_one_b.bubble <= 0.45


@pytest.mark.parametrize("case", _cases_of("zb-v", min_factor=2), ids=_case_id)
def test_zb_v_bubble_is_only_the_first_fill_and_below_zb_h1(case):
    _, p, m, _ = case
    zb_v, zb_h1 = _built(*case)[1], _built("zb-h1", p, m)[1]
    # What is left is the last rank waiting for its first forward: (p-1) half-size chunk forwards.
    assert _idle_per_rank(zb_v) == pytest.approx((p - 1) / 2)
    if p > 1:
        assert zb_v.bubble < zb_h1.bubble
    # the closed form (simulate.theoretical_bubble's docstring), against the simulated schedule
    assert zb_v.bubble == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-9)
    assert theoretical_bubble("zb-v", p, m) == pytest.approx(zb_v.bubble, abs=1e-9)


@pytest.mark.parametrize("p,m", [(1, 3), (2, 4), (4, 8), (4, 16), (8, 8), (8, 24)])
def test_peak_activations_in_flight(p, m):
    assert _built("gpipe", p, m)[1].peak_in_flight == (m,) * p
    one_f_one_b = _built("1f1b", p, m)[1].peak_in_flight
    assert one_f_one_b == tuple(p - r for r in range(p))
    # ZB-H1 keeps 1F1B's peak: rank 0's p. Its later ranks reach p too, holding inputs for
    # deferred W passes; capped at 1F1B's p - r they could not fill the cool-down.
    zb_h1 = _built("zb-h1", p, m)[1].peak_in_flight
    assert max(zb_h1) <= max(one_f_one_b) and zb_h1[0] == one_f_one_b[0]
    # ZB-V: 2p half-size chunk activations, the memory of p whole microbatches.
    assert max(_built("zb-v", p, m)[1].peak_in_flight) <= 2 * p


@pytest.mark.parametrize("args,message", [
    (("pipedream", 4, 8), "unknown schedule 'pipedream'; valid: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v"),
    (("1f1b", 0, 8), "stages must be an integer >= 1: got 0"),
    (("gpipe", 4, 0), "microbatches must be an integer >= 1: got 0"),
    (("interleaved-1f1b", 4, 6, 2), "interleaved-1f1b needs microbatches to be a multiple of the stages (4): got 6"),
    (("interleaved-1f1b", 4, 8, 1),
     "interleaved-1f1b needs at least 2 virtual stages (model chunks per rank): got 1"),
    (("1f1b", 4, 2), "1f1b needs at least as many microbatches (2) as stages (4); use --schedule gpipe for fewer"),
    (("zb-h1", 4, 3), "zb-h1 needs at least as many microbatches (3) as stages (4); use --schedule gpipe for fewer"),
    (("zb-v", 4, 2), "zb-v needs at least as many microbatches (2) as stages (4); use --schedule gpipe for fewer"),
    (("1f1b", 4, 8, 2), "1f1b runs one model chunk per rank: virtual stages must be 1: got 2"),
    (("zb-v", 4, 8, 3), "zb-v always runs 2 model chunks per rank (a V): virtual stages must be 2: got 3"),
])
def test_bad_input_gives_one_clear_line(args, message):
    problems = microbatch_problems(*args)
    assert len(problems) == 1 and problems[0].startswith(message)
    with pytest.raises(ValueError, match="^" + message[:30]):
        build_schedule(*args)


def test_every_problem_is_reported_at_once():
    assert len(microbatch_problems("interleaved-1f1b", 4, 6, 1)) == 2
    assert microbatch_problems("zb-v", 4, 8, 2) == [] and microbatch_problems("gpipe", 4, 2) == []


def test_out_of_order_lists_raise_deadlock_naming_the_stuck_ranks():
    schedule, _ = _built("1f1b", 2, 2)
    broken = dataclasses.replace(schedule, ranks=(tuple(reversed(schedule.ranks[0])), schedule.ranks[1]))
    with pytest.raises(ScheduleDeadlock, match=r"rank 0 at action 0 \(B1 on chunk 0\).*rank 1"):
        simulate(broken)


def test_text_timeline_1f1b_reads_like_the_seed_with_the_bubble_as_blanks():
    lines = format_timeline(build_schedule("1f1b", 4, 8)).splitlines()
    assert " ".join(lines[0].split()).startswith("Stage 0: F0 F1 F2 F3 B0")
    assert lines[0].startswith("Stage 0: F0 F1 F2 F3    ")  # rank 0 idles until B0 comes back
    assert lines[3].startswith("Stage 3:          F0 B0---")  # time-aligned: three forwards late
    assert lines[4].startswith("legend:")


def test_text_timeline_names_the_chunk_when_ranks_hold_several():
    text = format_timeline(build_schedule("interleaved-1f1b", 2, 4, 2))
    assert text.startswith("Stage 0: F0.0 F1.0 F0.1 F1.1")
    assert "F3.1 = microbatch 3 on the stage's second model chunk" in text
    assert "W0 " in format_timeline(build_schedule("zb-h1", 2, 4))


def test_draw_timeline_writes_a_png(tmp_path):
    path = draw_timeline(build_schedule("zb-v", 2, 4), tmp_path / "zbv.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_json_is_the_runtime_lists(tmp_path):
    path = tmp_path / "zbv.json"
    result = CliRunner().invoke(main, ["schedule", "--schedule", "zb-v", "--stages", "2",
                                       "--microbatches", "4", "--json", str(path)])
    assert result.exit_code == 0, result.output
    record = json.loads(path.read_text())
    assert set(record) == {"schedule", "stages", "microbatches", "virtual_stages", "bubble", "ranks"}
    schedule, timeline = _built("zb-v", 2, 4)
    assert (record["schedule"], record["stages"], record["microbatches"], record["virtual_stages"]) == ("zb-v", 2, 4, 2)
    assert record["bubble"] == pytest.approx(timeline.bubble)
    assert record["ranks"] == [[{"op": a.op, "microbatch": a.microbatch, "stage": a.stage} for a in rank]
                               for rank in schedule.ranks]


def test_cli_prints_timeline_bubbles_and_peaks():
    result = CliRunner().invoke(main, ["schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8"])
    assert result.exit_code == 0, result.output
    assert "Stage 0: F0 F1 F2 F3" in result.output
    assert "bubble: 27.3% simulated, 27.3% theoretical" in result.output
    assert "Stage 0: 4, Stage 1: 3, Stage 2: 2, Stage 3: 1" in result.output


def test_cli_bad_input_exits_2_with_one_line_per_problem():
    result = CliRunner().invoke(main, ["schedule", "--schedule", "interleaved-1f1b", "--stages", "4",
                                       "--microbatches", "6", "--virtual-stages", "1"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "paratrain schedule: error: interleaved-1f1b needs at least 2 virtual stages (model chunks per rank): got 1",
        "paratrain schedule: error: interleaved-1f1b needs microbatches to be a multiple of the stages (4): got 6",
    ]

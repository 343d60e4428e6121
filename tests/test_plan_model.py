"""The planner's cost model, search and command: pieces that have a right answer."""

import json
import math
import re
from dataclasses import replace

import pytest
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.parallel.pipeline.schedules import build_schedule
from paratrain.parallel.pipeline.simulate import simulate
from paratrain.plan.comm_model import collective_seconds
from paratrain.plan.cost_model import context_choice, predict
from paratrain.plan.hardware import PROFILE_DIR, Link, load_profile, shipped_profiles
from paratrain.plan.memory import Layout
from paratrain.plan.search import candidate_layouts, layout_problems, search
from paratrain.plan.shapes import GPTShape, named_shape


def test_simulator_takes_a_cost_per_chunk():
    schedule = build_schedule("interleaved-1f1b", 4, 8, 2)
    uniform = simulate(schedule, {"F": 1.0, "B": 2.0})
    listed = simulate(schedule, {"F": [1.0] * 8, "B": [2.0] * 8})
    assert listed.makespan == uniform.makespan and listed.bubble == uniform.bubble
    heavy_last = simulate(schedule, {"F": [1.0] * 7 + [3.0], "B": [2.0] * 7 + [6.0]})
    assert heavy_last.makespan > uniform.makespan


def test_ring_all_reduce_time_is_alpha_beta():
    profile = replace(load_profile("a100-80gb-hdr"), intra_node=Link(100, 1.0, 5))
    n, nbytes = 8, 1e9
    expected = 2 * (n - 1) * 5e-6 + 2 * (n - 1) / n * nbytes / 100e9
    assert collective_seconds(profile, "all_reduce", nbytes, n, spans_nodes=False) == pytest.approx(expected)
    assert collective_seconds(profile, "all_reduce", nbytes, 1, spans_nodes=False) == 0


def _free_links(profile):
    free = Link(1e12, 1.0, 0.0)
    return replace(profile, intra_node=free, inter_node=free)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_predicted_bubble_is_the_textbook_one_when_chunks_cost_the_same(schedule, v):
    """Free links and a tiny vocabulary make the chunks cost nearly the same: the bubble is then
    the schedule's closed form, (p-1)/(v*m+p-1), to within what the embedding and the V=8 head
    add to the end chunks (under 1%)."""
    profile = _free_links(load_profile("a100-80gb-hdr"))
    shape = GPTShape(layers=16, hidden=4096, heads=32, seq=2048, vocab=8)
    p, m = 4, 8
    prediction = predict(shape, Layout(pp=p, schedule=schedule, virtual_stages=v), profile, m)
    assert prediction.bubble == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-2)


def test_breakdown_adds_up_to_the_step_time():
    prediction = predict(named_shape("gpt3-175b"),
                         Layout(8, 8, 1, 1, "interleaved-1f1b", 3, "full"), load_profile("a100-80gb-hdr"), 64)
    assert sum(prediction.breakdown.values()) == pytest.approx(prediction.step_s)
    assert 0 < prediction.mfu < prediction.hfu < 1


def test_search_keeps_only_layouts_that_fit_fastest_first():
    profile = replace(load_profile("a100-80gb-hdr"), device_memory_gib=10, reserved_gib=0)
    shape = GPTShape(layers=16, hidden=4096, heads=32, seq=2048, vocab=32000)  # ~3.4B: 54 GB of state
    results, dropped = search(shape, 8, 16, profile)
    assert results and dropped["do_not_fit"] > 0
    assert all(p.memory.total <= profile.usable_bytes for p in results)
    assert [p.step_s for p in results] == sorted(p.step_s for p in results)
    # 54 GB does not fit on one 10 GiB device: split by tp or pp, or everything sharded over dp (ZeRO-3)
    assert all(p.layout.tp * p.layout.pp > 1 or p.layout.zero == 3 for p in results)
    assert any(p.layout.tp * p.layout.pp == 1 for p in results)


def test_search_tries_every_zero_stage_and_only_full_sharding_fits_a_model_too_big_for_the_rest():
    """~1.8B parameters, AdamW in fp32: 16 bytes each of state, 28 GB; on 4 devices of 8 GiB only
    ZeRO-3 (a quarter of everything per device, 7 GB) leaves room for activations."""
    profile = replace(load_profile("a100-80gb-hdr"), device_memory_gib=8, reserved_gib=0)
    shape = GPTShape(layers=24, hidden=2432, heads=32, seq=256, vocab=32000)
    results, _ = search(shape, 4, 4, profile)
    assert results and {p.layout.zero for p in results if p.layout.dp == 4} == {3}
    everything, _ = search(shape, 4, 4, replace(profile, device_memory_gib=80))
    assert {p.layout.zero for p in everything if p.layout.dp == 4} == {0, 1, 2, 3}


def test_layout_problems_name_each_violation():
    shape = named_shape("gpt-small")
    problems = layout_problems(shape, Layout(tp=3, pp=3, micro_batch=1, schedule="1f1b"), 2,
                               load_profile("a100-80gb-hdr"), gpus=8)
    text = "\n".join(problems)
    assert "not the 8 GPUs" in text and "tp 3 must divide" in text
    assert "at least as many microbatches" in text and "do not split evenly" in text


def test_shipped_profiles_give_a_source_for_every_value():
    assert {"a100-80gb-hdr", "h100-80gb-ndr"} <= set(shipped_profiles())
    for path in PROFILE_DIR.glob("*.yaml"):
        load_profile(path)
        for line in path.read_text().splitlines():
            if re.match(r"^\s*\w+:\s*\S", line) and not line.lstrip().startswith(("name:", "description:")):
                assert "#" in line, f"{path.name}: no source for {line.strip()!r}"


def test_plan_command_predicts_a_layout_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(main, [
        "plan", "--model", "gpt3-175b", "--hardware", "a100-80gb-hdr", "--gpus", "64", "--global-batch", "64",
        "--tp", "8", "--pp", "8", "--schedule", "interleaved-1f1b", "--virtual-stages", "3",
        "--recompute", "full", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "tp8 pp8 dp1 mb1 interleaved-1f1bx3 rc:full" in result.output
    (record,) = json.loads(out.read_text())
    assert {"layout", "step_s", "memory_gib", "bubble", "mfu", "breakdown"} <= set(record)
    assert record["layout"]["virtual_stages"] == 3 and math.isfinite(record["step_s"])


def test_plan_command_searches_and_refuses_impossible_layouts():
    runner = CliRunner()
    searched = runner.invoke(main, ["plan", "--model", "gpt-seed", "--gpus", "8", "--global-batch", "16", "--top", "3"])
    assert searched.exit_code == 0, searched.output
    assert "fastest:" in searched.output and "valid layouts" in searched.output
    refused = runner.invoke(main, ["plan", "--model", "gpt-small", "--tp", "3"])
    assert refused.exit_code == 2 and "tp 3 must divide" in refused.output


def test_context_parallelism_divides_activations_and_says_whether_its_ring_hides():
    """cp ranks keep 1/cp of every sequence's activations (as flash attention: no s x s scores);
    the ring's hops hide behind attention when each rank's block is long (on an A100 node, NVLink)."""
    profile = load_profile("a100-80gb-hdr")
    long = GPTShape(layers=32, hidden=4096, heads=32, seq=32768, vocab=32000, mlp=11008, kv_heads=8, gated=True)
    one, two, four = (predict(long, Layout(1, 1, 1, 1, cp=cp), profile, 8) for cp in (1, 2, 4))
    assert one.layout.gpus == 1 and four.layout.gpus == 4
    assert two.memory.activations / one.memory.activations == pytest.approx(0.5, rel=0.02)
    assert four.memory.activations / one.memory.activations == pytest.approx(0.25, rel=0.02)
    assert one.breakdown["cp_comm"] == 0 and four.breakdown["cp_comm"] == 0  # hidden behind attention
    short = replace(long, seq=512)
    exposed = predict(short, Layout(1, 1, 1, 1, cp=4), profile, 8)
    assert exposed.breakdown["cp_comm"] > 0  # 128-token blocks: a hop outlasts its block's attention
    assert sum(exposed.breakdown.values()) == pytest.approx(exposed.step_s)


def test_the_search_tries_context_parallelism_for_long_sequences_only():
    profile = load_profile("a100-80gb-hdr")
    long = GPTShape(layers=8, hidden=2048, heads=16, seq=16384, vocab=32000)
    assert {layout.cp for layout in candidate_layouts(long, 8, 8, profile)} == {1, 2, 4}  # >= 4096 tokens each
    assert {layout.cp for layout in candidate_layouts(replace(long, seq=2048), 8, 8, profile)} == {1}
    problems = layout_problems(replace(long, seq=100), Layout(cp=4), 8, profile, gpus=4)
    assert problems == ["the sequence (100) must divide by 2·cp = 8 (zigzag context parallelism)"]


def test_plan_predicts_a_context_parallel_layout_from_flags():
    result = CliRunner().invoke(main, ["plan", "--model", "llama-small", "--layers", "32", "--hidden", "4096",
                                       "--heads", "32", "--kv-heads", "8", "--seq", "32768", "--vocab", "32000",
                                       "--mlp", "11008", "--tp", "2", "--cp", "4", "--gpus", "8", "--global-batch", "8"])
    assert result.exit_code == 0, result.output
    assert "layout tp2 pp1 cp4 dp1" in result.output
    assert "cp comm" in result.output and "(the ring hides behind attention)" in result.output


def test_auto_picks_the_all_gather_where_the_ring_cannot_hide_and_the_ring_where_it_hides():
    """The ring's hops each race one block of attention; the all-gather is exposed whole. At 64
    tokens per rank on an H100 node the backward's hops (K/V and the fp32 dK/dV one behind) cost
    more than one gather and one reduce-scatter; at 4096 tokens per rank the ring hides."""
    profile = load_profile("h100-80gb-ndr")
    short = GPTShape(layers=8, hidden=128, heads=8, seq=512, vocab=512, mlp=384, kv_heads=2, gated=True)
    choice = context_choice(short, Layout(cp=8), profile)
    assert choice.method == "allgather" and not choice.ring_hides
    block = 2 * 1 * (512 // 8) * (128 * 2 // 8) * profile.software.activation_bytes  # K and V, kv heads only
    gather = collective_seconds(profile, "all_gather", 8 * block, 8, False)
    scatter = collective_seconds(profile, "reduce_scatter", 8 * block * 4 / profile.software.activation_bytes, 8, False)
    assert choice.allgather == pytest.approx((gather, gather + scatter))
    assert predict(short, Layout(cp=8), profile, 8).layout.cp_method == "allgather"  # auto, resolved
    assert predict(short, Layout(cp=8, cp_method="ring"), profile, 8).breakdown["cp_comm"] > 0
    long = replace(short, seq=32768)
    assert context_choice(long, Layout(cp=8), profile).method == "ring"
    assert context_choice(long, Layout(cp=8), profile).ring_hides


def test_plan_prints_the_race_between_the_ring_and_the_all_gather():
    result = CliRunner().invoke(main, ["plan", "--model", "llama-small", "--seq", "512", "--hardware", "h100-80gb-ndr",
                                       "--cp", "8", "--global-batch", "8"])
    assert result.exit_code == 0, result.output
    assert "layout tp1 pp1 cp8ag dp1" in result.output
    assert "the ring does not hide behind attention; auto picks allgather" in result.output
    forced = CliRunner().invoke(main, ["plan", "--model", "llama-small", "--seq", "512", "--hardware", "h100-80gb-ndr",
                                       "--cp", "8", "--cp-method", "ring", "--global-batch", "8"])
    assert "auto picks allgather, this run uses ring" in forced.output and "(the ring's hops" in forced.output

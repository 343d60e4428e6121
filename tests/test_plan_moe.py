"""The planner on mixtures of experts: parameters of every expert, active FLOPs, the experts'
memory divided over ep, expert parallelism's dedup dispatch priced as all-to-alls, and the
layouts `plan` refuses or searches."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.environment import Settings
from paratrain.models import PRESETS, moe_parameter_counts
from paratrain.plan.activations import Software
from paratrain.plan.comm_model import collective_seconds
from paratrain.plan.cost_model import predict
from paratrain.plan.flops import step_flops
from paratrain.plan.hardware import load_profile
from paratrain.plan.memory import Layout, memory_per_gpu
from paratrain.plan.moe import dispatch_bytes, ep_exchange, rows_per_token
from paratrain.plan.search import candidate_layouts
from paratrain.plan.shapes import named_shape
from paratrain.train.moe_plan import moe_plan_lines
from paratrain.train.options import validated_config

MOE_PRESETS = ("moe-tiny", "moe-small", "mixtral-8x7b", "olmoe-1b-7b")


def plan_output(*flags) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["plan", *map(str, flags)])
    return result.exit_code, result.output


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_the_moe_presets_count_every_expert_and_the_active_ones_as_the_models_do(name):
    shape = named_shape(name)
    assert (shape.parameters(), shape.parameters(active=True)) == moe_parameter_counts(PRESETS[name])


def test_mixtral_forward_flops_per_token_are_twice_its_active_weights_plus_attention():
    """By hand from Mixtral's published shape: per layer the q/o (h x h) and k/v (h x 1024)
    projections, the router (h x 8) and two experts of three h x 14336 matrices, 2 FLOPs per
    weight; the attention core 4 s h per token; the head 2 h V. The six other experts cost nothing."""
    h, s, V, l = 4096, 4096, 32000, 32
    shape = dataclasses.replace(named_shape("mixtral-8x7b"), seq=s)
    per_layer = 2 * (2 * h * h + 2 * h * 1024) + 2 * (h * 8 + 2 * 3 * h * 14336) + 4 * s * h
    forward_per_token = step_flops(shape, 1) / 3 / s
    assert forward_per_token == l * per_layer + 2 * h * V
    active = shape.parameters(active=True)
    embedding = V * h  # a lookup, not a matmul
    assert forward_per_token == pytest.approx(2 * (active - embedding) + l * 4 * s * h, rel=1e-4)
    assert forward_per_token < 0.4 * 2 * shape.parameters()  # against every expert: 12.9B of 46.7B


def test_expert_parallelism_divides_the_experts_memory_and_zero_leaves_them_whole():
    shape, fp32 = named_shape("moe-small"), Software(precision="fp32")
    experts = shape.moe_layers * shape.experts * shape.expert_weights()
    weights = {ep: memory_per_gpu(shape, Layout(dp=4, ep=ep), 16, fp32).weights for ep in (1, 2, 4)}
    assert weights[1] - weights[2] == 4 * experts / 2  # fp32: 4 bytes a weight
    assert weights[2] - weights[4] == 4 * experts / 4
    # Mixed precision, ZeRO-1: at ep 1 the experts' 12 bytes of optimizer state per parameter are
    # sharded over dp 4 as the rest's; at ep 2 each rank keeps its half of the experts' whole.
    zero1 = {ep: memory_per_gpu(shape, Layout(dp=4, ep=ep, zero=1), 16, Software()).optimizer for ep in (1, 2)}
    assert zero1[2] - zero1[1] == pytest.approx(12 * experts / 2 - 12 * experts / 4)


def test_rows_per_token_count_each_rank_a_token_needs_once():
    assert rows_per_token(8, 2, 2) == pytest.approx(11 / 7)  # 2·(1 − C(4,2)/C(8,2))
    assert rows_per_token(8, 2, 1) == 1  # one rank holds every expert
    assert rows_per_token(8, 2, 8) == pytest.approx(2)  # one expert a rank: once per expert
    assert rows_per_token(16, 2, 2) == pytest.approx(2 * (1 - 28 / 120))


def test_the_all_to_alls_are_dispatch_and_combine_each_way_of_rows_times_hidden():
    shape, profile = named_shape("moe-small"), load_profile("h100-80gb-ndr")  # no fitted all-to-all
    layout = Layout(dp=4, ep=2, micro_batch=2)
    rows = 2 * shape.seq * rows_per_token(16, 2, 2)
    assert dispatch_bytes(shape, layout, profile) == pytest.approx(rows * shape.hidden * 2)  # bf16
    link = profile.intra_node
    one = link.latency_us * 1e-6 + 0.5 * rows * shape.hidden * 2 / link.bytes_per_s  # (n−1)α + (n−1)/n·S/B
    assert collective_seconds(profile, "all_to_all", rows * shape.hidden * 2, 2, False) == pytest.approx(one)
    assert ep_exchange(shape, layout, profile) == pytest.approx((2 * one, 2 * one))
    prediction = predict(shape, layout, profile, 16)
    m = layout.microbatches(16)
    assert prediction.breakdown["ep_comm"] == pytest.approx(m * shape.moe_layers * 4 * one)
    assert predict(shape, Layout(dp=4, micro_batch=2), profile, 16).breakdown["ep_comm"] == 0


@pytest.mark.parametrize("flags, line", [
    (["--model", "gpt-small", "--dp", 2, "--ep", 2],
     "ep 2: expert parallelism needs a mixture of experts (moe-small, mixtral-8x7b, ...)"),
    (["--model", "moe-small", "--dp", 4, "--ep", 8], "ep 8 must divide dp x cp = 4 (its ranks are data ranks)"),
    (["--model", "moe-small", "--dp", 6, "--ep", 6, "--global-batch", 12], "ep 6 must divide the experts (16)"),
])
def test_plan_refuses_an_ep_that_cannot_run_in_one_line(flags, line):
    code, output = plan_output(*flags)
    assert code != 0
    assert output.splitlines() == [f"paratrain plan: error: this layout cannot run: {line}"]


def test_plan_prints_the_experts_and_the_all_to_all_time_of_expert_parallelism():
    code, output = plan_output("--model", "moe-small", "--hardware", "cpu-2core", "--dp", 4, "--ep", 2,
                               "--global-batch", 16)
    assert code == 0, output
    lines = output.splitlines()
    assert lines[0].startswith("moe-small: 5.5M parameters, 1.4M active (")
    assert "E=16 k=2 e=96 shared=1" in lines[0]
    assert any(line.split()[:2] == ["ep", "comm"] for line in lines)
    assert any("1.53 rows per token dispatched of 2 chosen (23% fewer than once per expert)" in line
               for line in lines)
    code, output = plan_output("--model", "moe-small", "--hardware", "cpu-2core", "--dp", 4, "--global-batch", 16)
    assert code == 0 and "ep comm" not in output


def test_the_search_tries_every_ep_dividing_the_data_ranks_and_the_experts():
    profile = load_profile("cpu-2core")
    eps = {layout.ep for layout in candidate_layouts(named_shape("moe-small"), 4, 16, profile)}
    assert eps == {1, 2, 4}
    assert {layout.ep for layout in candidate_layouts(named_shape("llama-small"), 4, 16, profile)} == {1}


def test_train_plan_only_lines_name_the_dispatch_on_the_local_profile():
    config, world = validated_config(None, {"model": "moe-small", "nproc": 4, "ep": 2}, Settings.resolve())
    lines = moe_plan_lines(config, world)
    assert lines[0] == ("mixture of experts: 16 experts of width 96, top-2 + 1 shared, in 8 of 8 layers; "
                        "5.5M parameters, 1.4M active per token")
    assert "1.53 rows per token dispatched" in lines[1] and "per step on profile cpu-2core" in lines[1]
    config, world = validated_config(None, {"model": "llama-small", "nproc": 2}, Settings.resolve())
    assert moe_plan_lines(config, world) == []


def test_train_plan_only_prints_the_moe_lines_before_any_rank_starts():
    result = CliRunner().invoke(main, ["train", "--model", "moe-small", "--nproc", "4", "--ep", "2", "--plan-only"])
    assert result.exit_code == 0, result.output
    assert "experts split over ep 2" in result.output
    assert "mixture of experts: 16 experts of width 96, top-2 + 1 shared" in result.output
    assert "rows per token dispatched of 2 chosen" in result.output

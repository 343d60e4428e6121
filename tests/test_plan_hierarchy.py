"""The planner's two levels: where a layout's groups sit on nodes (the Mesh's grid), the
hierarchical collectives' alpha-beta cost against the flat ring's, by hand, which one is picked
and when the pick switches, and the line `paratrain plan` prints for groups that span nodes."""

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.plan.comm_model import Placement, group_placement, price
from paratrain.plan.cost_model import predict
from paratrain.plan.hardware import Link, load_profile
from paratrain.plan.memory import Layout
from paratrain.plan.shapes import named_shape

A100 = load_profile("a100-80gb-hdr")  # 8 devices per node, no fitted collectives
# Round links for sums done by hand: 100 GB/s and 2 us inside a node, 10 GB/s and 10 us across.
ROUND = replace(A100, intra_node=Link(100, 1.0, 2), inter_node=Link(10, 1.0, 10))
TWO_NODES = Placement(size=16, nodes=2, per_node=8)
S = 1.6e9  # bytes: S/L = 0.2 GB crosses nodes in two levels


@pytest.mark.parametrize("op, hier_s, flat_s", [
    # RS inside (7 x 2 us + 7/8 x 1.6 GB / 100 GB/s = 14.014 ms), AR across of 0.2 GB among 2
    # (2 x 10 us + 2 x 1/2 x 0.2 GB / 10 GB/s = 20.02 ms), AG inside (14.014 ms); flat: 2 x 15 x
    # 10 us + 2 x 15/16 x 1.6 GB / 10 GB/s = 300.3 ms.
    ("all_reduce", 0.048048, 0.3003),
    # RS inside 14.014 ms, then RS across of 0.2 GB among 2 (10 us + 1/2 x 0.2 GB / 10 GB/s =
    # 10.01 ms); flat: 15 x 10 us + 15/16 x 1.6 GB / 10 GB/s = 150.15 ms. All-gather: the reverse.
    ("reduce_scatter", 0.024024, 0.15015),
    ("all_gather", 0.024024, 0.15015),
])
def test_two_levels_cost_what_the_hand_sum_says_on_two_nodes_of_eight(op, hier_s, flat_s):
    priced = price(ROUND, op, S, TWO_NODES)
    assert priced.hier_s == pytest.approx(hier_s, rel=1e-12)
    assert priced.flat_s == pytest.approx(flat_s, rel=1e-12)
    assert priced.algorithm == "hier"


def test_on_equal_links_two_levels_move_what_the_flat_ring_moves_with_fewer_latencies():
    """(L-1)/L + (h-1)/(hL) = (n-1)/n: the bandwidth terms agree; hier has 2(7 + 1) latencies, flat 2 x 15."""
    equal = replace(ROUND, intra_node=ROUND.inter_node)
    priced = price(equal, "all_reduce", S, TWO_NODES)
    assert priced.flat_s - priced.hier_s == pytest.approx(2 * (15 - 8) * 10e-6, rel=1e-9)


def test_the_pick_switches_from_flat_to_hier_as_messages_grow_when_the_node_is_slow_to_start():
    """Inside a node 100 us a step, across 10 us: hier's 2 x 7 steps inside cost more than the 2 x 7
    steps it saves across, until the bytes dominate."""
    slow_start = replace(ROUND, intra_node=Link(100, 1.0, 100))
    small, large = (price(slow_start, "all_reduce", nbytes, TWO_NODES) for nbytes in (1e3, 1e9))
    assert small.hier_s > small.flat_s and small.algorithm == "flat"
    assert large.hier_s < large.flat_s and large.algorithm == "hier"


@pytest.mark.parametrize("op, where, why", [
    ("all_reduce", Placement(8, 1, 8), None),  # one node: nothing crosses
    ("all_reduce", Placement(4, 4, 1), "one rank per node"),  # two levels are the flat ring
    ("all_reduce", Placement(12, 2, 0), "no two levels on uneven nodes"),
    ("all_to_all", TWO_NODES, "in two levels the same bytes cross nodes"),
])
def test_groups_without_a_second_level_stay_flat_and_say_why(op, where, why):
    priced = price(ROUND, op, S, where)
    assert priced.hier_s is None and priced.algorithm == "flat"
    if why:
        assert priced.describe("dp").endswith(f"({why})")


@pytest.mark.parametrize("layout, group, placement", [
    (Layout(dp=16), "dp_cp", Placement(16, 2, 8)),
    (Layout(tp=4, dp=8), "dp_cp", Placement(8, 4, 2)),
    (Layout(tp=8, dp=4), "dp_cp", Placement(4, 4, 1)),
    (Layout(tp=16), "tp", Placement(16, 2, 8)),
    # cp sits inside tp x cp = 4 devices even where pp pushes the replica across nodes
    (Layout(tp=2, cp=2, pp=4, dp=2), "cp", Placement(2, 1, 2)),
    (Layout(tp=2, cp=2, pp=4, dp=2), "pp", Placement(4, 2, 2)),
    # ep blocks of 8 data ranks 4 devices apart (tp x pp); edp: one rank of each block
    (Layout(pp=4, dp=16, ep=8), "ep", Placement(8, 4, 2)),
    (Layout(pp=4, dp=16, ep=8), "edp", Placement(2, 2, 1)),
])
def test_groups_sit_on_nodes_as_the_mesh_places_their_ranks(layout, group, placement):
    assert group_placement(A100, layout, group) == placement


def test_the_step_time_counts_the_flat_ring_and_the_prediction_knows_hier_is_cheaper():
    """The decision in comm_model.Priced.seconds: hier is reported, flat is charged."""
    prediction = predict(named_shape("gpt-small"), Layout(dp=16), A100, 64)
    reduction = prediction.collectives["dp"]
    assert reduction.op == "all_reduce" and reduction.where == Placement(16, 2, 8)
    assert reduction.algorithm == "hier" and reduction.hier_s < reduction.flat_s
    assert prediction.breakdown["dp_comm"] == pytest.approx(reduction.flat_s)  # dp_overlap 0 on this profile
    assert prediction.to_json()["across_nodes"]["dp"]["algorithm"] == "hier"


def test_a_zero_layout_prices_its_reduce_scatter_and_all_gather_as_one_entry():
    prediction = predict(named_shape("gpt-small"), Layout(dp=16, zero=1), A100, 64)
    both = prediction.collectives["dp"]
    assert both.op == "reduce_scatter + all_gather"
    assert prediction.breakdown["dp_comm"] == pytest.approx(both.flat_s)


def plan_output(*flags) -> str:
    result = CliRunner().invoke(main, ["plan", "--model", "gpt-small", "--hardware", "a100-80gb-hdr", *flags])
    assert result.exit_code == 0, result.output
    return result.output


def test_plan_says_which_algorithm_each_group_across_nodes_uses(tmp_path):
    out = tmp_path / "plan.json"
    text = plan_output("--tp", "16", "--heads", "16", "--dp", "2", "--json", str(out))
    assert "  across nodes, one call each (the step time counts flat, docs/planning.md):" in text
    tp_line = next(line for line in text.splitlines() if line.startswith("    tp all-reduce"))
    assert tp_line.startswith("    tp all-reduce spans 2 nodes, 8 ranks on each: hier ")
    assert "    dp all-reduce spans 2 nodes, 1 rank on each: flat " in text
    assert json.loads(out.read_text())[0]["across_nodes"]["tp"]["per_node"] == 8


def test_plan_says_nothing_about_nodes_when_every_group_fits_in_one():
    assert "across nodes" not in plan_output("--tp", "2", "--dp", "4")

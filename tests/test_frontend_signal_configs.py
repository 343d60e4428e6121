"""Signal configurations (GT's schema) and `paratrain frontend explain` drawing them: every
problem of a configuration said on its own line."""

import pathlib

import pytest


def test_every_problem_of_a_configuration_gets_its_own_line():
    from paratrain.frontend.signals import ConfigError, parse

    config = {
        "good": {"shard": {"axis": 1, "workers": [0, 1]}, "backward": "also_good"},
        "also_good": {"workers": [0, 1]},
        "typo": {"wokers": [0]},
        "far": {"shard": {"axis": 0, "workers": [0, 9]}},
        "dangling": {"workers": [1], "backward": "missing"},
    }
    with pytest.raises(ConfigError) as refused:
        parse(config, n_workers=4)
    problems = refused.value.problems
    assert "typo: unknown key 'wokers' (valid: backward, compile, shard, workers)" in problems
    assert "far: worker(s) [9] do not exist: there are 4 (0..3)" in problems
    # a backward naming no signal is not a problem here: registration is order-free, and the
    # name is looked up when a tensor first crosses into the region
    assert len(problems) == 2


def test_gt_keys_every_worker_replicated_and_compile():
    from paratrain.frontend.signals import parse

    parsed = parse({"all": {"shard": {"axis": 0, "workers": None}},
                    "copies": {"shard": {"axis": 0, "workers": None, "replicated": True}},
                    "compiled": {"compile": True},
                    "default_axis": {"shard": {"workers": [1]}}}, n_workers=3)
    assert parsed["all"].workers == (0, 1, 2) and parsed["all"].axis == 0
    assert parsed["copies"].workers == (0, 1, 2) and parsed["copies"].axis is None
    assert parsed["compiled"].workers == () and parsed["compiled"].compile  # places nothing
    assert parsed["default_axis"].axis == 0 and parsed["default_axis"].workers == (1,)


def test_the_seeds_schema_parses_with_replicated_and_split_signals():
    from paratrain.frontend.signals import parse

    parsed = parse({"pp_stage0": {"workers": [0, 1]},
                    "pp_stage0_colpar": {"shard": {"axis": 1, "workers": [0, 1]}}}, n_workers=2)
    assert parsed["pp_stage0"].axis is None and parsed["pp_stage0_colpar"].axis == 1


def test_explain_draws_the_seed_demo_as_four_stages_of_two():
    from click.testing import CliRunner

    from paratrain.cli import main

    config = pathlib.Path(__file__).parent.parent / "examples" / "tuning_demo" / "sharding_config.yaml"
    result = CliRunner().invoke(main, ["frontend", "explain", str(config)])
    assert result.exit_code == 0, result.output
    assert "pp_stage0_colpar  [0, 1]" in result.output and "split along axis -1, 2 parts" in result.output
    assert "4 pipeline stage(s) x 2-way tensor parallelism = 8 workers" in result.output
    assert "stage 3         w6      w7" in result.output


def test_explain_refuses_a_bad_file_with_its_lines(tmp_path):
    from click.testing import CliRunner

    from paratrain.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("a: {workers: [0], shard: {axis: 12}}\n")
    result = CliRunner().invoke(main, ["frontend", "explain", str(bad)])
    assert result.exit_code == 2 and "a: shard.axis must be an integer in [-8, 8), got 12" in result.output


def test_explain_says_where_a_regions_backward_runs():
    from paratrain.frontend.explain import describe
    from paratrain.frontend.signals import parse

    lines = "\n".join(describe(parse({
        "fwd": {"workers": [0, 1], "backward": "bwd"}, "bwd": {"workers": [2, 3]},
        "into": {"workers": [2, 3], "backward": "split"}, "split": {"shard": {"axis": 0, "workers": [2, 3]}},
    }, n_workers=4)))
    assert "backward on [2, 3] (bwd)" in lines  # the region's backward runs elsewhere (twins)
    assert "gradients back as split" in lines  # same workers: how moved tensors' gradients travel

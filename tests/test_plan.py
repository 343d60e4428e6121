"""Plans: patterns and styles, what the plan does to a model, and bad plans. Every bad plan is
one line that names the module or key, found before any rank starts (by `validate`, on a model
built on the meta device) and by `parallelize` itself."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import paratrain
from paratrain import run
from paratrain.models import build_model
from paratrain.models.plans import GPT_PLAN, LLAMA_PLAN
from paratrain.parallel.plan import PlanError, load_plan, matches, pipeline_layers, pipeline_problems, tp_problems_of
from paratrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from paratrain.train.config import ConfigError, TrainConfig, apply_overrides
from paratrain.train.setup import build_seeded_model
from paratrain.train.validate import validate


def test_a_star_matches_exactly_one_path_part():
    assert matches("layers.*.attn.wq", "layers.3.attn.wq")
    assert not matches("layers.*.attn.wq", "layers.3.attn")
    assert not matches("layers.*", "layers.3.attn")
    assert matches("layers.1?.mlp", "layers.12.mlp") and not matches("layers.1?.mlp", "layers.2.mlp")


def parallelize_llama_rank(group):
    model = build_seeded_model("llama-tiny", {}, 0)
    paratrain.parallelize(model, LLAMA_PLAN, group)
    attn = model.layers[0].attn
    return {"types": (type(model.tok_emb), type(attn.wq), type(attn.wo), type(model.output)),
            "heads": (attn.n_heads, attn.n_kv_heads), "wk": tuple(attn.wk.weight.shape)}


def test_the_llama_plan_shards_its_layers_and_divides_its_head_counts():
    out = run(parallelize_llama_rank, 2)[0]
    assert out["types"] == (VocabParallelEmbedding, ColumnParallelLinear, RowParallelLinear, ColumnParallelLinear)
    assert out["heads"] == (2, 1)  # 4 query and 2 key/value heads over tp 2
    assert out["wk"] == (16, 64)  # one key head of width 16


def test_the_gpt_reads_as_embedding_blocks_and_head_by_its_plan():
    model = build_model("gpt-tiny")
    layers = pipeline_layers(model, load_plan(GPT_PLAN))
    assert len(layers) == model.config.n_layer + 2
    idx_BT = torch.randint(256, (2, 8))
    x = idx_BT
    for layer in layers:
        x = layer(x)
    torch.testing.assert_close(x, model(idx_BT))


def meta_llama(**overrides) -> nn.Module:
    with torch.device("meta"):
        return build_model("llama-tiny", **overrides)


def edited(plan: dict, section: str, **changes) -> dict:
    plan = copy.deepcopy(plan)
    for key, value in changes.items():
        key = key.replace("__", ".").replace(".x.", ".*.")  # layers__x__attn: layers.*.attn
        if value is None:
            del plan[section][key]
        else:
            plan[section][key] = value
    return plan


# (plan, tp, pp chunks, sequence parallel, model overrides, the expected line)
BAD_PLANS = [
    pytest.param({**LLAMA_PLAN, "tensor_paralel": {}}, 2, 1, False, {},
                 "unknown key 'tensor_paralel'", id="unknown-key"),
    pytest.param(edited(LLAMA_PLAN, "tensor_parallel", layers__x__attn__wq="columnwise"), 2, 1, False, {},
                 "layers.*.attn.wq: unknown style 'columnwise'", id="unknown-style"),
    pytest.param(edited(LLAMA_PLAN, "tensor_parallel", layers__x__attention__wq="colwise"), 2, 1, False, {},
                 "pattern 'layers.*.attention.wq' matches no module of Llama", id="matches-nothing"),
    pytest.param(edited(LLAMA_PLAN, "tensor_parallel", layers__0__attn__wq="rowwise"), 2, 1, False, {},
                 "module layers.0.attn.wq is matched by 'layers.*.attn.wq' and 'layers.0.attn.wq' with different styles",
                 id="two-styles"),
    pytest.param(edited(LLAMA_PLAN, "tensor_parallel", norm="colwise"), 2, 1, False, {},
                 "norm: style colwise needs an nn.Linear (or transformers' Conv1D), but the module is a RMSNorm", id="style-does-not-fit"),
    pytest.param(LLAMA_PLAN, 2, 1, False, {"d_mlp": 191},
                 "layers.0.mlp.w1: colwise splits out_features (191) into 1 part(s) x tp (2), which does not divide it",
                 id="colwise-does-not-divide"),
    pytest.param(edited(LLAMA_PLAN, "tensor_parallel", layers__x__mlp__w1=None, layers__x__mlp__w3=None), 4, 1,
                 False, {"d_mlp": 194}, "layers.0.mlp.w2: rowwise splits in_features (194), which tp (4) does not divide",
                 id="rowwise-does-not-divide"),
    pytest.param(LLAMA_PLAN, 4, 1, False, {},
                 "layers.0.attn: n_kv_heads (2) is not divisible by tp (4): each rank computes whole heads",
                 id="heads-do-not-divide"),
    pytest.param(edited(LLAMA_PLAN, "head_counts", layers__x__attn=["n_head"]), 2, 1, False, {},
                 "layers.0.attn: has no integer attribute 'n_head' holding a head count", id="no-head-attribute"),
    pytest.param({k: v for k, v in LLAMA_PLAN.items() if k != "sequence_parallel"}, 2, 1, True, {},
                 "sequence parallelism needs sequence_parallel.gather_inputs", id="sequence-parallel-nowhere"),
    pytest.param(edited(LLAMA_PLAN, "pipeline", blocks="blocks"), 1, 2, False, {},
                 "pipeline names 'blocks', which is no module of Llama", id="no-block-list"),
    pytest.param(edited(LLAMA_PLAN, "pipeline", blocks="norm"), 1, 2, False, {},
                 "pipeline.blocks 'norm' must be a non-empty ModuleList, got RMSNorm", id="blocks-not-a-list"),
    pytest.param(edited(LLAMA_PLAN, "pipeline", after=["final_norm", "output"]), 1, 2, False, {},
                 "pipeline names 'final_norm', which is no module of Llama", id="after-names-nothing"),
    pytest.param(LLAMA_PLAN, 1, 2, False, {"tie_embeddings": True},
                 "a parameter is used both before and after the blocks (tied embeddings?)", id="tied-across-stages"),
    pytest.param(edited(LLAMA_PLAN, "tensor_parallel", layers__x__attn__wo={"style": "rowwise", "parts": 2}), 2, 1,
                 False, {}, "layers.*.attn.wo: parts must be a positive integer, and only colwise takes it",
                 id="parts-on-rowwise"),
]


def plan_problems(plan, tp, chunks, sequence_parallel, overrides) -> list[str]:
    model = meta_llama(**overrides)
    try:
        plan = load_plan(plan)
    except PlanError as error:
        return [str(error)]
    problems = tp_problems_of(model, plan, tp, sequence_parallel) if tp > 1 else []
    return problems + (pipeline_problems(model, plan, chunks) if chunks > 1 else [])


@pytest.mark.parametrize("plan, tp, chunks, sequence_parallel, overrides, line", BAD_PLANS)
def test_a_bad_plan_is_one_line_naming_the_module(plan, tp, chunks, sequence_parallel, overrides, line):
    problems = plan_problems(plan, tp, chunks, sequence_parallel, overrides)
    assert problems, "the plan was accepted"
    assert any(line in problem for problem in problems), problems
    assert all("\n" not in problem for problem in problems)


def test_the_good_plans_have_no_problems():
    assert plan_problems(LLAMA_PLAN, 2, 2, True, {}) == []
    with torch.device("meta"):
        gpt = build_model("gpt-tiny")
    assert tp_problems_of(gpt, load_plan(GPT_PLAN), 4, True) == []


def test_a_plan_file_that_is_not_yaml_is_one_line(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("tensor_parallel: {layers.*.attn.wq: colwise\n")
    with pytest.raises(PlanError, match=r"plan.yaml is not valid YAML at line 2") as error:
        load_plan(path)
    assert "\n" not in str(error.value)


def test_validate_reports_a_bad_plan_file_before_any_rank_starts(tmp_path):
    plan = edited(LLAMA_PLAN, "tensor_parallel", layers__x__attn__wq="columnwise")
    path = tmp_path / "plan.yaml"
    path.write_text(__import__("yaml").safe_dump(plan))
    config = apply_overrides(TrainConfig(), {"model.name": "llama-tiny", "model.plan": str(path), "parallel.tp": 2})
    with pytest.raises(ConfigError) as error:
        validate(config, 2)
    assert error.value.problems == [f"model.plan: {path}: layers.*.attn.wq: unknown style 'columnwise'; "
                                    "valid: colwise, rowwise, vocab_embed, vocab_head, replicate"]


def parallelize_bad_rank(group):
    paratrain.parallelize(build_seeded_model("llama-tiny", {}, 0), LLAMA_PLAN, group)


def test_parallelize_refuses_a_plan_the_world_does_not_divide():
    with pytest.raises(PlanError, match=r"^layers.0.attn: n_kv_heads \(2\) is not divisible by tp \(4\)"):
        run(parallelize_bad_rank, 4)


def parallelize_tied_rank(group, embed_style):
    model = build_seeded_model("llama-tiny", {"tie_embeddings": True}, 0)
    plan = copy.deepcopy(LLAMA_PLAN)
    plan["tensor_parallel"]["tok_emb"] = embed_style
    paratrain.parallelize(model, plan, group)
    return model.output.weight is model.tok_emb.weight


def test_tied_embeddings_stay_tied_when_split_alike_and_are_refused_otherwise():
    assert run(parallelize_tied_rank, 2, args=("vocab_embed",)) == {0: True, 1: True}
    with pytest.raises(PlanError, match=r"^plan: tok_emb.weight and output.weight are one tied parameter, "
                                        r"but the plan splits them differently"):
        run(parallelize_tied_rank, 2, args=("replicate",))


def test_measured_costs_time_every_layer_and_leave_no_gradients():
    from paratrain.parallel.pipeline.split import layer_costs

    model = build_model("llama-tiny", n_layer=3)
    layers = pipeline_layers(model, load_plan(LLAMA_PLAN))
    costs = layer_costs(layers, "measured", torch.randint(256, (2, 16)))
    assert len(costs) == 5 and all(isinstance(c, int) and c >= 1 for c in costs)
    assert all(p.grad is None for p in model.parameters())
    assert layer_costs(layers, "count") == [0, 1, 1, 1, 0]


def sequence_parallel_by_plan_rank(group, enabled, flag):
    plan = copy.deepcopy(LLAMA_PLAN)
    plan["sequence_parallel"]["enabled"] = enabled
    model = paratrain.parallelize(build_seeded_model("llama-tiny", {}, 0), plan, group, sequence_parallel=flag)
    return model.layers[0].attn.wo.sequence_parallel


def test_a_plan_may_switch_sequence_parallelism_on_and_a_run_may_too():
    assert run(sequence_parallel_by_plan_rank, 2, args=(True, None))[0] is True
    assert run(sequence_parallel_by_plan_rank, 2, args=(False, None))[0] is False
    assert run(sequence_parallel_by_plan_rank, 2, args=(False, True))[0] is True


def test_a_head_count_the_plan_forgets_is_a_problem_unless_it_opts_out():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "own_model"
    spec = importlib.util.spec_from_file_location("own_model_for_test", path / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.device("meta"):
        model = module.build()
    plan = load_plan(path / "plan.yaml")
    assert tp_problems_of(model, plan, 2) == []
    plan.head_counts = {}
    assert tp_problems_of(model, plan, 2)[0] == (
        "blocks.0.attention: has heads (6), a head count the plan does not divide: list it in head_counts "
        "(or the module with [] if it reads its heads from its input)")
    plan.head_counts = {"blocks.*.attention": []}
    assert tp_problems_of(model, plan, 2) == []

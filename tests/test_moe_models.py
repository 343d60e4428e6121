"""The MoE Llama: parameter counts (built and computed, and the published Mixtral-8x7B and
OLMoE-1B-7B figures on the meta device), which layers are MoE, one-line config problems, its
plan, the FLOPs the meta model is counted at, and that it learns, through `paratrain train` too."""

from __future__ import annotations

import re

import pytest
import torch
from click.testing import CliRunner
from torch.utils.flop_counter import FlopCounterMode

from paratrain.cli import main
from paratrain.data import build_dataset
from paratrain.models import build_model, count_parameters, model_config, parameter_count
from paratrain.models.llama import SwiGLU
from paratrain.models.meta import on_meta
from paratrain.models.moe import MoEFeedForward
from paratrain.models.moe_llama import moe_parameter_counts
from paratrain.models.plans import MOE_PLAN, default_plan
from paratrain.parallel.plan import load_plan, pipeline_layers, pipeline_problems, tp_problems_of


@pytest.mark.parametrize("name", ["moe-tiny", "moe-small"])
def test_moe_llama_maps_idx_BT_to_logits_BTV_and_counts_its_parameters(name):
    model = build_model(name)
    vocab = model.config.vocab_size
    assert model(torch.randint(vocab, (2, 7))).shape == (2, 7, vocab)
    total, active = moe_parameter_counts(model.config)
    assert count_parameters(model) == parameter_count(model.config) == total > active


# Published: Mixtral-8x7B 46.7B total, 12.9B active (Mistral AI); OLMoE-1B-7B 6.9B total, 1.3B
# active (Muennighoff et al. 2024). Each is rounded to 0.1B: OLMoE's active count, 1.282B, is
# 1.4% under its rounded 1.3B (within the rounding, not within 1%), so its tolerance is 1.5%.
@pytest.mark.parametrize("name, total, active, active_tolerance", [
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.01),
    ("olmoe-1b-7b", 6.9e9, 1.3e9, 0.015),
])
def test_published_moe_presets_have_their_published_parameter_counts(name, total, active, active_tolerance):
    config = model_config(name)
    with on_meta():
        model = build_model(name)
    counted_total, counted_active = moe_parameter_counts(config)
    assert count_parameters(model) == counted_total
    assert counted_total == pytest.approx(total, rel=0.01)
    assert counted_active == pytest.approx(active, rel=active_tolerance)
    assert round(counted_active / 1e8) / 10 == active / 1e9  # the published figure, as rounded


def test_moe_every_and_first_dense_layers_choose_the_moe_layers():
    model = build_model("moe-tiny", n_layer=6, first_dense_layers=1, moe_every=2)
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds == [SwiGLU, MoEFeedForward, SwiGLU, MoEFeedForward, SwiGLU, MoEFeedForward]
    assert count_parameters(model) == parameter_count(model.config)


def test_the_same_seed_gives_the_same_weights():
    def weights():
        torch.manual_seed(3)
        return build_model("moe-tiny").state_dict()

    first, second = weights(), weights()
    assert all(torch.equal(first[k], second[k]) for k in first)
    experts = build_model("moe-tiny").layers[0].mlp.experts
    assert experts.w1.std().item() == pytest.approx(0.02, rel=0.1)  # Llama's std; w2 scaled by depth
    assert experts.w2.std().item() == pytest.approx(0.02 / 2, rel=0.1)


@pytest.mark.parametrize("overrides, message", [
    ({"top_k": 9}, "top_k (9) must be at most n_experts (8)"),
    ({"n_experts": 0}, "n_experts must be a positive integer, got 0"),
    ({"n_shared_experts": -1}, "n_shared_experts must be a non-negative integer, got -1"),
    ({"score_func": "relu"}, "score_func must be one of softmax, sigmoid, got 'relu'"),
    ({"expert_compute": "bmm"}, "expert_compute must be one of grouped, loop, got 'bmm'"),
    ({"capacity_factor": 0}, "capacity_factor must be a number > 0 or null (dropless), got 0"),
    ({"aux_loss_coef": -1.0}, "aux_loss_coef must be a number >= 0, got -1.0"),
    ({"first_dense_layers": 2}, "first_dense_layers (2) leaves no MoE layer in 2"),
    ({"n_kv_head": 3}, "n_head (4) must be divisible by n_kv_head (3)"),
])
def test_an_invalid_moe_config_is_one_line_naming_the_field(overrides, message):
    with pytest.raises(ValueError) as error:
        model_config("moe-tiny", **overrides)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith("invalid MoEConfig: ")


def test_the_moe_plan_splits_attention_only_and_reads_as_the_model():
    with torch.device("meta"):
        meta = build_model("moe-tiny")
    plan = load_plan(default_plan(meta))
    assert default_plan(meta) is MOE_PLAN
    assert tp_problems_of(meta, plan, 2, True) == [] and pipeline_problems(meta, plan, 2) == []
    assert not any("mlp" in pattern for pattern in MOE_PLAN["tensor_parallel"])
    model = build_model("moe-tiny").eval()
    idx_BT = torch.randint(256, (2, 8))
    x = idx_BT
    for layer in pipeline_layers(model, plan):
        x = layer(x)
    torch.testing.assert_close(x, model(idx_BT))


def test_a_meta_layer_counts_the_flops_of_an_even_dropless_routing():
    """The MFU count runs the model on the meta device, where a choice has no values: the routed
    experts count as top_k of them per token."""
    with on_meta():
        layer = build_model("moe-tiny").layers[0].mlp
    N, D, E, K, F = 2 * 16, 64, 8, 2, 64
    counter = FlopCounterMode(display=False)
    with counter:
        layer(torch.empty(2, 16, D, device="meta"))
    gate, routed, shared = 2 * N * D * E, 2 * N * K * 3 * D * F, 2 * N * 3 * D * F
    assert counter.get_total_flops() == gate + routed + shared


def test_moe_tiny_learns_the_token_chain():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # too small a model for an op to be worth splitting across threads
    try:
        torch.manual_seed(0)
        data = build_dataset("tokens", seed=0)
        model = build_model("moe-tiny")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        held_out = data.global_batch(10_000, 32)
        for step in range(40):
            inputs, targets = data.global_batch(step, 8)
            loss = data.loss(model(inputs), targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            after = data.loss(model(held_out[0]), held_out[1]).item()
    finally:
        torch.set_num_threads(threads)
    assert after < 3.0  # from log(256) = 5.55


def test_paratrain_train_trains_moe_tiny_on_one_process():
    result = CliRunner().invoke(main, ["train", "--model", "moe-tiny", "--nproc", "1", "--steps", "20"])
    assert result.exit_code == 0, result.output
    first, last = re.search(r"final loss\s+([\d.]+) \(from ([\d.]+)\)", result.output).group(2, 1)
    assert float(last) < float(first) - 0.2, result.output

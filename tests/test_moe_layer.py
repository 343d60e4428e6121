"""The mixture-of-experts layer: against a per-token reference written out here (outputs and
every gradient, fp64, 1e-10: the same arithmetic in another order), grouped against looped
experts, the balance loss's gradient, the same gradients whether a batch runs whole or in
halves, the bias rule, and the capacity rule."""

import math

import pytest
import torch
import torch.nn.functional as F

from paratrain.models.moe import MoEFeedForward, moe_statistics, update_router_bias
from paratrain.models.moe_llama import MoEConfig

D, E = 8, 6


def make_layer(dtype=torch.float64, seed=0, **overrides) -> MoEFeedForward:
    fields = dict(d_model=D, n_head=2, n_kv_head=1, n_experts=E, top_k=2, d_expert=12, n_shared_experts=1,
                  aux_loss_coef=0.0, expert_compute="loop")
    config = MoEConfig(**{**fields, **overrides})
    config.validate()
    torch.manual_seed(seed)
    layer = MoEFeedForward(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer.to(dtype)


def expert_swiglu(x_D, w1_DF, w3_DF, w2_FD):
    return (F.silu(x_D @ w1_DF) * (x_D @ w3_DF)) @ w2_FD


def reference(layer: MoEFeedForward, x_BTD: torch.Tensor, drops: list | None = None) -> torch.Tensor:
    """Token by token: scores, the choice (highest biased score first, lower index on ties),
    the gate weights, the capacity rule in position order, the experts' weighted sum. Each
    dropped (sequence, position, expert) is appended to `drops`."""
    router, experts = layer.router, layer.experts
    B, T, _ = x_BTD.shape
    capacity = None if router.capacity_factor is None else math.ceil(router.capacity_factor * T * router.top_k / E)
    rows = []
    for b in range(B):
        used = [0] * E
        for t in range(T):
            x_D = x_BTD[b, t]
            logits_E = x_D @ router.gate.weight.T
            scores_E = logits_E.softmax(-1) if router.score_func == "softmax" else logits_E.sigmoid()
            biased = (scores_E.detach() + router.expert_bias).tolist()
            chosen = sorted(range(E), key=lambda e: (-biased[e], e))[:router.top_k]
            weights = scores_E[chosen]
            if router.renormalize:
                weights = weights / weights.sum()
            out_D = torch.zeros_like(x_D)
            for e, w in zip(chosen, weights):
                used[e] += 1
                if capacity is None or used[e] <= capacity:
                    out_D = out_D + w * expert_swiglu(x_D, experts.w1[e], experts.w3[e], experts.w2[e])
                elif drops is not None:
                    drops.append((b, t, e))
            if layer.shared is not None:
                out_D = out_D + layer.shared(x_D)
            rows.append(out_D)
    return torch.stack(rows).view(B, T, -1)


def grads_of(layer, x_BTD, forward, weights_BTD):
    layer.zero_grad()
    x = x_BTD.clone().requires_grad_()
    out = forward(layer, x)
    (out * weights_BTD).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def assert_same(a, b, tol):
    out_a, x_a, params_a = a
    out_b, x_b, params_b = b
    torch.testing.assert_close(out_a, out_b, rtol=tol, atol=tol)
    torch.testing.assert_close(x_a, x_b, rtol=tol, atol=tol)
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        torch.testing.assert_close(params_a[name], params_b[name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("n_shared", [0, 1])
def test_layer_matches_the_per_token_reference_outputs_and_gradients(top_k, score_func, renormalize, n_shared):
    layer = make_layer(top_k=top_k, score_func=score_func, renormalize=renormalize, n_shared_experts=n_shared)
    x_BTD = torch.randn(2, 5, D, dtype=torch.float64)
    w_BTD = torch.randn(2, 5, D, dtype=torch.float64)
    assert_same(grads_of(layer, x_BTD, MoEFeedForward.__call__, w_BTD), grads_of(layer, x_BTD, reference, w_BTD), 1e-10)


def test_capacity_drops_the_latest_tokens_of_each_expert_in_each_sequence_as_the_reference_does():
    layer = make_layer(capacity_factor=0.5)  # capacity ceil(0.5 * 7 * 2 / 6) = 2 pairs per expert
    x_BTD = torch.randn(3, 7, D, dtype=torch.float64)
    w_BTD = torch.randn(3, 7, D, dtype=torch.float64)
    drops = []
    assert_same(grads_of(layer, x_BTD, MoEFeedForward.__call__, w_BTD),
                grads_of(layer, x_BTD, lambda m, x: reference(m, x, drops), w_BTD), 1e-10)
    assert layer.tokens_per_expert.sum().item() == 3 * 7 * 2  # the choices, drops included
    assert layer.dropped_pairs.item() == len(drops) > 0


def test_grouped_experts_equal_the_loop_in_fp32():
    grouped, loop = make_layer(torch.float32, expert_compute="grouped"), make_layer(torch.float32)
    x_BTD, w_BTD = torch.randn(4, 16, D), torch.randn(4, 16, D)
    assert grouped.experts.grouped_fits(x_BTD.view(-1, D))
    assert_same(grads_of(grouped, x_BTD, MoEFeedForward.__call__, w_BTD),
                grads_of(loop, x_BTD, MoEFeedForward.__call__, w_BTD), 1e-5)


def test_grouped_falls_back_to_the_loop_where_grouped_mm_does_not_run():
    fp64 = make_layer(expert_compute="grouped")  # grouped_mm has no fp64 kernel
    odd = make_layer(torch.float32, expert_compute="grouped", d_expert=7)  # 28-byte rows
    assert not fp64.experts.grouped_fits(torch.zeros(1, D, dtype=torch.float64))
    assert not odd.experts.grouped_fits(torch.zeros(1, D))
    x_BTD = torch.randn(2, 4, D, dtype=torch.float64)
    torch.testing.assert_close(fp64(x_BTD), make_layer()(x_BTD), rtol=0, atol=0)
    assert odd(x_BTD.float()).shape == (2, 4, D)


def explicit_balance_loss(layer, x_BTD, coef):
    """coef x mean over sequences of sum_i f_i P_i, counted token by token."""
    B, T, _ = x_BTD.shape
    K = layer.top_k
    total = 0
    for b in range(B):
        counts, probs = [0] * E, 0
        for t in range(T):
            logits_E = x_BTD[b, t] @ layer.router.gate.weight.T
            scores_E = logits_E.softmax(-1) if layer.router.score_func == "softmax" else logits_E.sigmoid()
            biased = (scores_E.detach() + layer.router.expert_bias).tolist()
            for e in sorted(range(E), key=lambda e: (-biased[e], e))[:K]:
                counts[e] += 1
            probs = probs + scores_E / scores_E.sum()
        total = total + sum(E / (K * T) * counts[e] * probs[e] / T for e in range(E))
    return coef * total / B


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_the_attached_balance_loss_has_the_gradient_of_the_explicit_loss_added_to_the_loss(score_func):
    coef = 0.3
    with_aux = make_layer(score_func=score_func, aux_loss_coef=coef)
    x_BTD, w_BTD = torch.randn(3, 6, D, dtype=torch.float64), torch.randn(3, 6, D, dtype=torch.float64)
    attached = grads_of(with_aux, x_BTD, MoEFeedForward.__call__, w_BTD)
    explicit_value = explicit_balance_loss(with_aux, x_BTD, coef)

    def plain_plus_explicit(layer, x):
        layer.aux_loss_coef = 0.0
        out = layer(x)
        # its gradient rides on the output's: d(sum(out * w) + aux) / d anything
        return out + explicit_balance_loss(layer, x, coef) * w_BTD / (w_BTD * w_BTD).sum()

    explicit = grads_of(with_aux, x_BTD, plain_plus_explicit, w_BTD)
    assert_same(attached, (attached[0],) + explicit[1:], 1e-10)
    assert with_aux.last_aux_loss.item() == pytest.approx(explicit_value.item(), rel=1e-12)


def run_steps(layer, x_BTD, w_BTD, parts):
    """One step's gradients with the batch in `parts` calls, the loss a mean over the whole
    batch's tokens, gradients accumulated."""
    layer.zero_grad()
    layer.global_sequences = x_BTD.shape[0]
    for x_part, w_part in zip(x_BTD.chunk(parts), w_BTD.chunk(parts)):
        (layer(x_part) * w_part).sum().div(x_BTD.shape[:2].numel()).backward()
    stats = moe_statistics(torch.nn.Sequential(layer))[0]
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    update_router_bias(layer)
    return grads, stats, layer.router.expert_bias.clone()


def test_a_batch_in_two_halves_gives_the_whole_batchs_gradients_counts_drops_and_bias():
    overrides = dict(aux_loss_coef=0.1, bias_update_rate=0.01, capacity_factor=0.7)
    x_BTD, w_BTD = torch.randn(4, 9, D, dtype=torch.float64), torch.randn(4, 9, D, dtype=torch.float64)
    whole, halves = make_layer(**overrides), make_layer(**overrides)
    for layer in (whole, halves):
        layer.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))
    for step in range(2):  # the second step chooses with the first's updated bias
        grads_w, stats_w, bias_w = run_steps(whole, x_BTD, w_BTD, 1)
        grads_h, stats_h, bias_h = run_steps(halves, x_BTD, w_BTD, 2)
        for name in grads_w:
            torch.testing.assert_close(grads_h[name], grads_w[name], rtol=1e-10, atol=1e-12, msg=name)
        assert stats_h["tokens_per_expert"] == stats_w["tokens_per_expert"]
        assert stats_h["dropped_pairs"] == stats_w["dropped_pairs"] > 0
        assert torch.equal(bias_h, bias_w)


def test_bias_update_follows_the_sign_rule_and_resets_the_counts():
    layer = make_layer(bias_update_rate=0.25)
    layer(torch.randn(2, 10, D, dtype=torch.float64))
    counts = layer.tokens_per_expert.clone()
    assert counts.sum().item() == 2 * 10 * 2
    seen = []

    def reduce(c):  # stands for a sum over ranks: here, another rank with the same counts
        seen.append(c.clone())
        return c * 2

    update_router_bias(layer, reduce)
    assert torch.equal(seen[0], counts)
    expected = 0.25 * torch.sign(counts.double().mean() - counts.double())
    torch.testing.assert_close(layer.router.expert_bias, expected.to(layer.router.expert_bias.dtype))
    assert layer.tokens_per_expert.sum().item() == 0 and layer.dropped_pairs.item() == 0


def test_the_bias_changes_the_choice_but_not_the_gate_weights():
    layer = make_layer(renormalize=False)
    x_BTD = torch.randn(2, 5, D, dtype=torch.float64)
    before = layer.router(x_BTD)
    layer.router.expert_bias[E - 1] = 10.0  # expert E-1 now first for every token
    after = layer.router(x_BTD)
    assert (after.experts_BTK[..., 0] == E - 1).all() and not torch.equal(before.experts_BTK, after.experts_BTK)
    scores_BTE = layer.router.gate(x_BTD).softmax(-1)
    torch.testing.assert_close(after.weights_BTK, scores_BTE.gather(-1, after.experts_BTK), rtol=0, atol=0)


def test_expert_bias_is_checkpointed_and_the_counts_are_not():
    state = make_layer().state_dict()
    assert "router.expert_bias" in state and "tokens_per_expert" not in state and "dropped_pairs" not in state


def test_equal_scores_go_to_the_lower_expert_index():
    layer = make_layer(top_k=3)
    with torch.no_grad():
        layer.router.gate.weight.zero_()  # every score equal
    assert layer.router(torch.randn(2, 4, D, dtype=torch.float64)).experts_BTK.tolist() == [[[0, 1, 2]] * 4] * 2


def test_a_layer_in_eval_mode_counts_nothing_and_attaches_no_loss():
    layer = make_layer(aux_loss_coef=0.1).eval()
    layer(torch.randn(2, 4, D, dtype=torch.float64))
    assert layer.tokens_per_expert.sum().item() == 0 and layer.last_aux_loss is None

"""The parity matrix in CI: every model and every data-parallel strategy trained against one
process at least once (a diagonal through the grid, each cell on a layout it supports), and every
cell of the whole grid either accepted or refused in one line before any rank starts.
`make matrix` runs the whole grid."""

from __future__ import annotations

import pytest

from paratrain.parallel.data.strategy import STRATEGIES
from paratrain.train.matrix import LAYOUTS, MODELS, cell_config, cells, refusal, render, run_cell
from paratrain.train.validate_experts import EXPERT_STRATEGIES


def diagonal_model(i: int) -> str:
    """The diagonal's model for the i-th strategy: the models in turn, so each comes at least once."""
    return list(MODELS)[i % len(MODELS)]


def diagonal_layout(i: int, model: str, strategy: str):
    """The first layout validation accepts for this cell, starting from a different one each time.
    Chosen when the test runs, not when it is collected: validating the cells costs seconds, and
    every test worker collects this file."""
    turned = LAYOUTS[i % len(LAYOUTS):] + LAYOUTS[:i % len(LAYOUTS)]
    return next(layout for layout in turned if not refusal(cell_config(model, strategy, layout), layout.world))


DIAGONAL = [(diagonal_model(i), strategy, i) for i, strategy in enumerate(STRATEGIES)]


def test_the_diagonal_covers_every_model_and_every_strategy():
    assert {model for model, _, _ in DIAGONAL} == set(MODELS)
    assert {strategy for _, strategy, _ in DIAGONAL} == set(STRATEGIES)


@pytest.mark.parametrize("model, strategy, i", DIAGONAL, ids=[f"{m}-{s}" for m, s, _ in DIAGONAL])
def test_a_cell_trains_the_same_model_as_one_process(model, strategy, i):
    layout = diagonal_layout(i, model, strategy)
    record = run_cell(model, strategy, layout)
    assert record["status"] == "PASS", record


def test_every_cell_of_the_grid_runs_or_is_refused_in_one_line():
    reasons = {}  # each cell's refusal, worked out once (a meta model each: 4 ms)
    for model, strategy, layout in cells():
        reason = reasons[model, strategy, layout.name] = refusal(cell_config(model, strategy, layout), layout.world)
        assert "\n" not in reason and "Traceback" not in reason, (model, strategy, layout.name, reason)
    # What must run does: the strategies that compose with tp and pp on every model in data
    # parallelism, and on the language models in every layout; what cannot is said (the MLP has no
    # tensor parallelism, tied embeddings cannot be cut into pipeline stages, only language models'
    # sequences split over cp, and local SGD's replicas would drift apart within a sequence).
    for model in MODELS:
        for strategy in (name for name, s in STRATEGIES.items() if s.with_tp_pp):
            for layout in LAYOUTS:
                reason = reasons[model, strategy, layout.name]
                language_model = model not in ("mlp", "cnn")
                tied_pipeline = model == "llama-tiny tied" and layout.pp > 1
                context, moe, hf = layout.cp > 1, model == "moe-tiny", model.startswith("hf:")
                runs = (layout.tp == layout.pp == 1 and not context) or (language_model and not tied_pipeline)
                # a mixture of experts: not with sp, nor its balance loss with cp; ep only for it;
                # transformers' layers take no sequence-parallel gather
                runs = runs and not ((moe or hf) and layout.sp) and not (moe and context) and (layout.ep == 1 or moe)
                if runs and not (context and strategy == "local-sgd") and not (layout.ep > 1 and strategy
                                                                               not in EXPERT_STRATEGIES):
                    assert not reason, (model, strategy, layout.name, reason)
                if context and not language_model:
                    assert "splits the sequences of language models" in reason
                if layout.ep > 1 and not moe:
                    assert "has none (moe-tiny" in reason
    assert any(reasons.values())


def test_the_page_numbers_each_refusal_once_and_shows_a_failure_with_its_reason():
    records = [
        {"model": "m", "strategy": "a", "layout": "dp 2", "status": "PASS", "reason": "", "seconds": 1.0},
        {"model": "m", "strategy": "a", "layout": "tp 2", "status": "refused", "reason": "no tp", "seconds": 0.0},
        {"model": "m", "strategy": "b", "layout": "dp 2", "status": "FAIL", "reason": "beyond", "seconds": 1.0},
        {"model": "m", "strategy": "b", "layout": "tp 2", "status": "refused", "reason": "no tp", "seconds": 0.0},
    ]
    page = "\n".join(render(records))
    assert "| a | PASS | refused (1) |" in page and "| b | **FAIL**: beyond | refused (1) |" in page
    assert "1. no tp" in page and "2." not in page and "4 cells: 1 PASS, 2 refused" in page

"""Llama through its plan trains like one process: tensor parallelism with grouped-query
attention (n_kv_heads = 2 over tp = 2: one key/value head per rank), the pipeline (1F1B and
ZB-H1), tp x pp x dp with sequence parallelism, tied embeddings under tp, and activation
checkpointing of the blocks the plan names.

As test_parallel_3d.py: 2 steps of SGD with momentum on the threads launcher against the plain
one-process loop, same weights and batches, fp32. Losses within 1e-5 relative, parameters
within 1e-6 absolute: only the order of floating-point sums differs (measured ~1e-7 and ~1e-8).
"""

from __future__ import annotations

import functools

import pytest

from paratrain import run
from paratrain.train.check import compare
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.validate import validate
from tests.test_data_parallel import reference_for

LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-6

# (dp, pp, tp, schedule, microbatches, extra options). Every feature of the docstring, and each pair
# of them that meets in the plan, at least once: tp 2 at pp 1 is the tied-embeddings layout's, and
# pp 2 under 1F1B at tp 1 the measured-balance test's (below).
CONFIGS = [
    (1, 2, 1, "zb-h1", 4, {}),
    (2, 2, 2, "1f1b", 4, {"parallel.sequence_parallel": True}),
    (1, 1, 2, None, 1, {"parallel.sequence_parallel": True, "model.tie_embeddings": True}),
    (1, 2, 2, "zb-h1", 4, {"parallel.checkpoint_activations": True}),
]


def llama_config(dp, pp, tp, schedule, microbatches, extra) -> TrainConfig:
    overrides = {
        "model.name": "llama-tiny", "steps": 2, "log_every": 100, "data.global_batch": 16,
        "optim.name": "sgd", "optim.lr": 0.1, "parallel.pp": pp, "parallel.tp": tp,
        "parallel.microbatches": microbatches, "parallel.nproc": dp * pp * tp, **extra,
    }
    if schedule:
        overrides["parallel.schedule"] = schedule
    return apply_overrides(TrainConfig(), overrides)


@pytest.mark.parametrize(
    "dp, pp, tp, schedule, microbatches, extra", CONFIGS,
    ids=[f"dp{c[0]}-pp{c[1]}-tp{c[2]}-{c[3] or 'none'}" + "".join(f"-{k.split('.')[1]}" for k in c[5]) for c in CONFIGS],
)
def test_llama_trains_like_one_process(dp, pp, tp, schedule, microbatches, extra):
    config = llama_config(dp, pp, tp, schedule, microbatches, extra)
    world = dp * pp * tp
    validate(config, world)
    results = run(functools.partial(train_rank, return_state=True), world, args=(config,))
    report = compare(config, results, reference_for(config))
    assert not report["missing"], f"parameters no rank reported: {report['missing']}"
    assert report["max_loss_diff"] <= LOSS_RTOL, report["loss_diffs"]
    assert report["max_param_diff"] <= PARAM_ATOL, (report["worst_param"], report["max_param_diff"])


def test_stages_balanced_by_measured_time_train_like_one_process(tmp_path):
    import yaml

    from paratrain.models.plans import LLAMA_PLAN

    plan = {**LLAMA_PLAN, "pipeline": {**LLAMA_PLAN["pipeline"], "balance": "measured"}}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    config = llama_config(1, 2, 1, "1f1b", 2, {"model.plan": str(path), "model.n_layer": 4})
    validate(config, 2)
    results = run(functools.partial(train_rank, return_state=True), 2, args=(config,))
    report = compare(config, results, reference_for(config))
    assert not report["missing"] and report["max_loss_diff"] <= LOSS_RTOL
    assert report["max_param_diff"] <= PARAM_ATOL

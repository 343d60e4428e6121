"""Property tests over the training configuration (hypothesis).

The contract of `validate`: a configuration it accepts trains; one it refuses is refused before
any rank starts, with one line per problem. So for any drawn combination of model, world size,
data-parallel mode, algorithm, tensor/pipeline sizes, schedule and options, either validate
raises ConfigError with one-line problems, or one training step runs to the end on the
threads launcher. A combination that passes validation and then fails inside the ranks is the
bug this test exists to catch (e.g. `--zero 1 --algo tree` once failed deep in the ranks).

The examples are derandomized: CI sees the same ones every run.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from paratrain import run
from paratrain.comm.algorithms import algorithms_for
from paratrain.parallel.pipeline.schedules import SCHEDULES
from paratrain.train.config import ConfigError, TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.validate import validate

# Small models, so one step costs milliseconds; a GPT of 4 pipeline layers splits into 2 x 2 chunks.
MODELS = {
    "mlp": {"model.hidden": 16},
    "mlp16": {"model.width": 16, "model.depth": 4},
    "gpt-tiny": {"model.n_layer": 2, "model.d_model": 32, "model.n_head": 2, "model.d_mlp": 64, "model.block_size": 16},
}


@st.composite
def configurations(draw):
    """Half coherent layouts (world = dp x pp x tp, enough microbatches), half anything:
    uniform draws over every field would almost never be valid, and the valid ones are
    where late failures hide."""
    model = draw(st.sampled_from(sorted(MODELS)))
    pp, tp, dp = (draw(st.sampled_from([1, 2])) for _ in range(3))
    coherent = draw(st.booleans())
    special = draw(st.sampled_from(["none", "zero", "compress", "local_sgd"]))
    if coherent and special != "none":
        pp = tp = 1  # ZeRO, compression and local SGD are data parallelism alone
    world = dp * pp * tp if coherent else draw(st.sampled_from([1, 2, 4]))
    schedule = draw(st.sampled_from(SCHEDULES))
    virtual = 2 if schedule in ("interleaved-1f1b", "zb-v") and coherent else draw(st.sampled_from([1, 2]))
    overrides = {
        "model.name": model, **MODELS[model], "steps": 1, "log_every": 100,
        "data.global_batch": 8 if coherent else draw(st.sampled_from([4, 6, 8])),
        "parallel.nproc": world, "parallel.pp": pp, "parallel.tp": tp,
        "parallel.dp_mode": draw(st.sampled_from(["naive", "ddp", "ddp", "torch"])),
        "parallel.algo": draw(st.sampled_from(algorithms_for("all_reduce") + ("nonsense",))),
        "parallel.grad_accum": draw(st.sampled_from([1, 1, 2])),
        "parallel.zero": int(special == "zero"),
        "parallel.compress": draw(st.sampled_from(["bf16", "topk:0.5"])) if special == "compress" else "none",
        "parallel.local_sgd": 2 if special == "local_sgd" else 0,
        "parallel.schedule": schedule,
        "parallel.microbatches": 4 if coherent else draw(st.sampled_from([1, 2, 4])),
        "parallel.virtual_stages": virtual,
        "parallel.precision": draw(st.sampled_from(["fp32", "bf16"])),
        "parallel.checkpoint_activations": draw(st.booleans()),
        "optim.name": draw(st.sampled_from(["sgd", "adamw"])),
    }
    return apply_overrides(TrainConfig(), overrides), world


def _case(world, **overrides):
    base = {"model.name": "mlp", **MODELS["mlp"], "steps": 1, "data.global_batch": 8, "parallel.nproc": world}
    return apply_overrides(TrainConfig(), {**base, **overrides}), world


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(configurations())
# Combinations that once passed validation and failed inside the ranks, always tried:
@example(_case(2, **{"parallel.zero": 1, "parallel.algo": "tree"}))
@example(_case(2, **{"parallel.compress": "topk:0.5", "parallel.algo": "tree"}))
def test_a_configuration_is_refused_up_front_or_trains_a_step(drawn):
    config, world = drawn
    try:
        validate(config, world)
    except ConfigError as error:
        assert error.problems, "ConfigError without problems"
        for problem in error.problems:
            assert problem and "\n" not in problem, f"not one line: {problem!r}"
        return
    results = run(train_rank, world, args=(config,), timeout=60)
    assert sorted(results) == list(range(world))
    loss = results[0]["log"][0]["loss"]
    assert loss == loss and loss > 0, f"loss {loss}"


@pytest.mark.parametrize("overrides, problem", [
    ({"parallel.zero": 1, "parallel.algo": "tree"}, "parallel.algo"),
    ({"parallel.algo": "nonsense"}, "parallel.algo"),
    ({"parallel.algo": "ring", "parallel.dp_mode": "torch"}, "torch-ddp .PyTorch's DistributedDataParallel. runs its own collectives"),
    ({"parallel.microbatches": 4}, "--microbatches shape the pipeline and need pp > 1"),
    ({"parallel.schedule": "zb-v"}, "--schedule shape the pipeline"),
    ({"parallel.virtual_stages": 2}, "--virtual-stages shape the pipeline"),
    ({"model.name": "gpt-tiny", "parallel.pp": 2, "parallel.microbatches": 2, "parallel.grad_accum": 2},
     "--grad-accum applies to pp = 1"),
    ({"data.name": "tokens"}, "trains on 'teacher' data, not 'tokens'"),
])
def test_known_late_failures_are_refused_up_front(overrides, problem):
    config = apply_overrides(TrainConfig(), {"model.name": "mlp", **overrides})
    with pytest.raises(ConfigError, match=problem):
        validate(config, 2)

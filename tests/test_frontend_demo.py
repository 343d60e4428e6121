"""The seed's demo through the frontend trains exactly like one process and like `paratrain
train`, whatever the YAML file says: TP=2 x PP=4 (the seed's), TP=4 x PP=2, TP=1 x PP=8 and pure
data parallelism, with the model code unchanged.

gpt-small with a 16-token context (to stay quick on 2 cores), 2 steps of AdamW at a constant
learning rate, the same initial weights and token batches as the reference: the second step's
loss comes through the weights the first update moved, so forward, backward and the optimizer
are all compared. Tolerance: 1e-5 relative on every step's loss (fp32; only the order of sums
differs).
"""

import os
import sys

import pytest

from paratrain.frontend.client.autostart import LocalServer

DEMO = os.path.join(os.path.dirname(__file__), "..", "examples", "tuning_demo")
sys.path.insert(0, DEMO)

STEPS, GLOBAL_BATCH, LR, OVERRIDES = 2, 16, 3e-3, {"block_size": 16}


@pytest.fixture(scope="module")
def server():
    srv = LocalServer.start(8, extra_args=("--threads", "1"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference_losses():
    from paratrain.train.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
    from paratrain.train.reference import reference_run

    config = TrainConfig(model=ModelConfig("gpt-small", dict(OVERRIDES)), data=DataConfig(global_batch=GLOBAL_BATCH),
                         optim=OptimConfig("adamw", lr=LR, schedule="constant"), steps=STEPS)
    return reference_run(config)[0]


@pytest.fixture(scope="module")
def frontend_losses(server):
    """The demo's losses for a layout, trained once per layout (two tests train the seed's)."""
    trained = {}

    def losses(config_name, microbatches, schedule="1f1b", virtual_stages=1):
        key = (config_name, microbatches, schedule, virtual_stages)
        if key not in trained:
            trained[key] = _frontend_losses(server, *key)
        return trained[key]

    return losses


def _frontend_losses(server, config_name, microbatches, schedule, virtual_stages):
    import paratrain.frontend as gt
    from train import train

    gt.connect(server.address)
    try:
        record = train(os.path.join(DEMO, config_name), "small", steps=STEPS, global_batch=GLOBAL_BATCH,
                       microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages, lr=LR,
                       overrides=OVERRIDES, log=lambda line: None)
    finally:
        gt.disconnect()
    return record["losses"]


def _relative(ours, reference):
    return max(abs(a - b) / abs(b) for a, b in zip(ours, reference))


@pytest.mark.parametrize("config_name, microbatches, schedule, virtual_stages", [
    ("sharding_config.yaml", 4, "1f1b", 1),
    ("sharding_config.yaml", 4, "interleaved-1f1b", 2),
    ("tp4_pp2.yaml", 4, "1f1b", 1),
    ("tp1_pp8.yaml", 8, "gpipe", 1),
    ("dp8.yaml", 1, "1f1b", 1),
])
def test_the_demo_trains_like_one_process_from_any_layout(frontend_losses, reference_losses, config_name,
                                                          microbatches, schedule, virtual_stages):
    losses = frontend_losses(config_name, microbatches, schedule, virtual_stages)
    assert len(losses) == STEPS
    assert _relative(losses, reference_losses) <= 1e-5, (losses, reference_losses)
    assert losses[-1] < losses[0]


def test_the_seed_layout_matches_paratrain_train_tp2_pp4(frontend_losses):
    from paratrain.launch import run
    from paratrain.train.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
    from paratrain.train.loop import train_rank

    config = TrainConfig(model=ModelConfig("gpt-small", dict(OVERRIDES)), data=DataConfig(global_batch=GLOBAL_BATCH),
                         optim=OptimConfig("adamw", lr=LR, schedule="constant"), steps=STEPS, log_every=10**9,
                         parallel=ParallelConfig(tp=2, pp=4, schedule="1f1b", microbatches=4))
    results = run(train_rank, 8, launcher="threads", args=(config,))
    spmd = [entry["loss"] for entry in results[min(results)]["log"]]
    assert _relative(frontend_losses("sharding_config.yaml", 4), spmd) <= 1e-5


def test_zero_bubble_schedules_are_refused_with_the_reason():
    from paratrain.frontend.client.pipeline import issue_order
    from paratrain.parallel.pipeline.schedules import build_schedule

    with pytest.raises(ValueError, match="splits backward into B and W"):
        issue_order(build_schedule("zb-h1", 2, 4))

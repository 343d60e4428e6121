"""--data FILE.py:FUNCTION and --loss FILE.py:FUNCTION: a user's data set and loss, drawn from
and checked as ours are (one-line errors before any rank starts)."""

from __future__ import annotations

import textwrap

import pytest

import paratrain
from paratrain.data import build_dataset
from paratrain.train.check import compare, passes, tolerances
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.reference import reference_run
from paratrain.train.validate import problems_with

DATA = textwrap.dedent('''
    import torch

    def pairs():  # 200 sequences of 65 tokens: (the first 64, the last 64)
        rows = torch.randint(0, 256, (200, 65), generator=torch.Generator().manual_seed(0))
        return [(row[:-1], row[1:]) for row in rows]

    def regression():
        x = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.TensorDataset(x, (2 * x[:, :10]).contiguous())

    def smoothed(outputs, targets):
        return torch.nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1),
                                                 label_smoothing=0.1)

    def not_a_data_set():
        return 5

    def not_pairs():
        return [torch.zeros(3)] * 10
''')


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "my_data.py"
    path.write_text(DATA)
    return path


def config_with(**overrides) -> TrainConfig:
    base = {"model.name": "gpt-tiny", "steps": 4, "log_every": 100, "data.global_batch": 16, "optim.lr": 0.5}
    return apply_overrides(TrainConfig(), {**base, **overrides})


def train_and_return_state(group, config):
    return train_rank(group, config, return_state=True)


@pytest.mark.parametrize("world, overrides", [
    pytest.param(4, {"parallel.pp": 2, "parallel.microbatches": 2}, id="pp2-dp2"),
    pytest.param(2, {"parallel.zero": 3}, id="zero3"),
])
def test_your_data_and_loss_train_like_one_process(data_file, world, overrides):
    config = config_with(**{"data.name": f"{data_file}:pairs", "data.loss": f"{data_file}:smoothed", **overrides})
    assert problems_with(config, world) == []
    report = compare(config, paratrain.run(train_and_return_state, world, args=(config,)), reference_run(config))
    assert passes(report, tolerances(config)), report
    plain = config_with(**{"data.name": f"{data_file}:pairs", "steps": 1})  # label smoothing changes the loss
    assert reference_run(plain).losses[0] != pytest.approx(report["reference_losses"][0], rel=1e-4)


def test_float_targets_train_a_regression_with_mean_squared_error(data_file):
    config = config_with(**{"model.name": "mlp", "data.name": f"{data_file}:regression", "optim.lr": 0.05,
                            "steps": 30, "eval_every": 29})
    log = paratrain.run(train_rank, 2, args=(config,))[0]["log"]
    assert log[-1]["loss"] < 0.5 * log[0]["loss"] and "val_loss" in log[-1]


def test_validation_holds_out_a_tenth_that_training_never_draws(data_file):
    dataset = build_dataset("user", 0, spec=f"{data_file}:pairs")
    assert len(dataset.held_out) == 20 and not set(dataset.held_out.tolist()) & set(dataset.train.tolist())
    x, y = dataset.global_batch(3, 8)
    assert x.shape == (8, 64) and y.shape == (8, 64) and dataset.task == "language_modeling"
    again, _ = build_dataset("user", 0, spec=f"{data_file}:pairs").global_batch(3, 8)
    assert (x == again).all()  # the same batches on every rank and run


@pytest.mark.parametrize("data, loss, overrides, message", [
    ("not_a_data_set", None, {}, "data.name: data {f}:not_a_data_set returned a int: a data set needs len() and [i]"),
    ("not_pairs", None, {}, "data.name: data {f}:not_pairs: item 0 is a Tensor, not an (inputs, targets) pair"),
    ("pairs", "missing", {}, "data.loss: loss file {f} has no function 'missing'"),
    ("pairs", "smoothed", {"parallel.tp": 2}, "data.loss: {f}:smoothed needs whole logits"),
])
def test_a_bad_data_set_or_loss_is_one_line_before_any_rank_starts(data_file, data, loss, overrides, message):
    config = config_with(**{"data.name": f"{data_file}:{data}", **overrides})
    if loss:
        config.data.loss = f"{data_file}:{loss}"
    problems = problems_with(config, 2)
    assert len(problems) == 1 and problems[0].startswith(message.format(f=data_file)), problems


def test_a_missing_data_file_is_one_line(tmp_path):
    problems = problems_with(config_with(**{"data.name": f"{tmp_path}/nope.py:pairs"}), 2)
    assert problems == [f"data.name: data file {tmp_path}/nope.py not found"]

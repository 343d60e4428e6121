"""Configuration: YAML and flags, and every validation error, each with its message."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.train.config import ConfigError, TrainConfig, apply_overrides, load_yaml
from paratrain.train.validate import problems_with


def problems(world_size=2, **overrides):
    return problems_with(apply_overrides(TrainConfig(), overrides), world_size)


def test_default_config_is_valid():
    assert problems() == []


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        ({"data.global_batch": 30}, 4, "data.global_batch 30 is not divisible by data-parallel size 4 x grad_accum 1 = 4"),
        ({"data.global_batch": 64, "parallel.grad_accum": 3}, 2, "not divisible by data-parallel size 2 x grad_accum 3 = 6"),
        ({"model.name": "resnet"}, 2, "model: unknown model 'resnet'; valid: mlp, mlp16, cnn"),
        ({"model.name": "mlp", "model.widht": 3}, 2, "model 'mlp' has no option 'widht'; valid: in_dim, hidden, classes"),
        ({"optim.lr": 0.0}, 2, "optim.lr must be positive, got 0.0"),
        ({"optim.lr": -1.0}, 2, "optim.lr must be positive"),
        ({"optim.name": "lamb"}, 2, "optim.name: unknown value 'lamb'; valid: sgd, adamw"),
        ({"optim.momentum": 1.5}, 2, "optim.momentum must be in [0, 1)"),
        ({"optim.schedule": "step"}, 2, "optim.schedule: unknown value 'step'; valid: cosine, constant"),
        ({"steps": 0}, 2, "steps must be an integer >= 1, got 0"),
        ({"parallel.nproc": 0}, 2, "parallel.nproc must be an integer >= 1, got 0"),
        ({"parallel.launcher": "mpi"}, 2, "parallel.launcher: unknown value 'mpi'; valid: threads, processes"),
        ({"parallel.dp_mode": "fsdp"}, 2, "parallel.dp_mode: unknown value 'fsdp'; valid: naive, ddp, torch"),
        ({"parallel.algo": "bruck"}, 2, "parallel.algo: unknown value 'bruck'; valid: ring, hd, tree, direct, native, auto"),
        ({"parallel.bucket_mb": 0}, 2, "parallel.bucket_mb must be positive"),
        ({"parallel.compress": "int8"}, 2, "parallel.compress: unknown compression 'int8'"),
        ({"parallel.compress": "topk:1.5"}, 2, "top-k ratio must be in (0, 1], got 1.5"),
        ({"parallel.zero": 3}, 2, "parallel.zero must be 0 or 1 (ZeRO-1), got 3"),
        ({"parallel.zero": 1, "parallel.local_sgd": 2}, 2, "local_sgd and zero cannot be combined"),
        ({"parallel.dp_mode": "torch", "parallel.compress": "fp16"}, 2, "compress is ours, not PyTorch DDP's"),
        ({"data.name": "imagenet"}, 2, "data.name: unknown value 'imagenet'"),
    ],
)
def test_each_bad_setting_is_reported_with_its_message(overrides, world_size, message):
    found = problems(world_size, **overrides)
    assert any(message in line for line in found), found


def test_all_problems_are_reported_at_once():
    found = problems(4, **{"optim.lr": -1.0, "steps": 0, "data.global_batch": 30})
    assert len(found) == 3


def test_yaml_is_loaded_and_flags_override_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 7\nmodel: {name: cnn, hidden: 32}\noptim: {name: adamw, lr: 0.002}\n")
    config = apply_overrides(load_yaml(path), {"optim.lr": 0.004})
    assert config.steps == 7 and config.model.name == "cnn" and config.model.overrides == {"hidden": 32}
    assert config.optim.name == "adamw" and config.optim.lr == 0.004


def test_yaml_unknown_keys_name_the_valid_ones(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("stepz: 7\noptim: {lrr: 1}\n")
    with pytest.raises(ConfigError) as error:
        load_yaml(path)
    assert "unknown key 'stepz'; valid: model, data, optim, parallel, steps" in str(error.value)
    assert "unknown key 'optim.lrr'; valid: name, lr, momentum" in str(error.value)


def test_train_command_rejects_bad_config_before_starting():
    result = CliRunner().invoke(main, ["train", "--nproc", "4", "--global-batch", "30", "--lr", "-1"])
    assert result.exit_code == 2
    assert "error: optim.lr must be positive" in result.output
    assert "error: data.global_batch 30 is not divisible by data-parallel size 4" in result.output


def test_train_command_writes_metrics(tmp_path):
    out = tmp_path / "metrics.json"
    result = CliRunner().invoke(main, [
        "train", "--model", "cnn", "--channels", "8", "16", "--hidden", "32", "--nproc", "2",
        "--steps", "3", "--global-batch", "16", "--metrics-out", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert "cnn:" in result.output and "parameters" in result.output
    data = json.loads(out.read_text())
    assert data["config"]["model"]["overrides"] == {"channels": [8, 16], "hidden": 32}
    assert len(data["log"]) == 3
    for key in ("final_loss", "steps", "samples_per_s", "step_ms", "compute_ms", "comm_ms", "exposed_comm_ms"):
        assert key in data["summary"]

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
        ({"optim.lr": 0.0}, 2, "optim.lr must be a finite number > 0, got 0.0"),
        ({"optim.lr": -1.0}, 2, "optim.lr must be a finite number > 0"),
        ({"optim.lr": float("nan")}, 2, "optim.lr must be a finite number > 0, got nan"),
        ({"optim.lr": float("inf")}, 2, "optim.lr must be a finite number > 0, got inf"),
        ({"optim.weight_decay": float("inf")}, 2, "optim.weight_decay must be a finite number >= 0, got inf"),
        ({"parallel.timeout": float("nan")}, 2, "parallel.timeout must be a finite number of seconds > 0, got nan"),
        ({"optim.name": "lamb"}, 2, "optim.name: unknown value 'lamb'; valid: sgd, adamw"),
        ({"optim.momentum": 1.5}, 2, "optim.momentum must be in [0, 1)"),
        ({"optim.schedule": "step"}, 2, "optim.schedule: unknown value 'step'; valid: cosine, constant"),
        ({"steps": 0}, 2, "steps must be an integer >= 1, got 0"),
        ({"parallel.nproc": 0}, 2, "parallel.nproc must be an integer >= 1, got 0"),
        ({"parallel.launcher": "mpi"}, 2, "parallel.launcher: unknown value 'mpi'; valid: threads, processes"),
        ({"parallel.dp_mode": "zero4"}, 2, "--dp-mode: unknown value 'zero4'; valid: naive, ddp, torch-ddp, torch, zero1, "
         "torch-zero1, zero2, fsdp, zero3, torch-fsdp, local-sgd"),
        ({"parallel.algo": "bruck"}, 2, "parallel.algo: unknown value 'bruck'; valid: ring, hd, tree, direct, native, auto"),
        ({"parallel.bucket_mb": 0}, 2, "parallel.bucket_mb must be a finite number > 0"),
        ({"parallel.compress": "int8"}, 2, "parallel.compress: unknown compression 'int8'"),
        ({"parallel.compress": "topk:1.5"}, 2, "top-k ratio must be in (0, 1], got 1.5"),
        ({"parallel.zero": 4}, 2, "--zero must be 0, 1 (optimizer state sharded), 2 (and gradients) or 3 (and parameters: FSDP), got 4"),
        ({"parallel.zero": 1, "parallel.local_sgd": 2}, 2, "--local-sgd 2 averages parameters instead of gradients, which zero1 does not"),
        ({"parallel.dp_mode": "torch", "parallel.compress": "fp16"}, 2, "compression is for naive and ddp (all-reduced gradients), not torch-ddp"),
        ({"parallel.dp_mode": "naive", "parallel.zero": 2}, 2, "--dp-mode naive shards nothing and --zero 2 asks for optimizer state and gradients: give one of them"),
        ({"parallel.dp_mode": "torch", "parallel.zero": 2}, 2, "PyTorch has no ZeRO-2"),
        ({"parallel.dp_mode": "local-sgd"}, 2, "local-sgd needs its period, --local-sgd K"),
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
    assert "unknown key 'stepz'; valid: model, data, optim, parallel, checkpoint, steps" in str(error.value)
    assert "unknown key 'optim.lrr'; valid: name, lr, momentum" in str(error.value)


def test_train_command_rejects_bad_config_before_starting():
    result = CliRunner().invoke(main, ["train", "--nproc", "4", "--global-batch", "30", "--lr", "-1"])
    assert result.exit_code == 2
    assert "paratrain train: error: optim.lr must be a finite number > 0" in result.output
    assert "paratrain train: error: data.global_batch 30 is not divisible by data-parallel size 4" in result.output


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


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        ({"model.name": "gpt-small", "parallel.dp": 2, "parallel.pp": 2, "parallel.tp": 4}, 8,
         "world size 8 != dp x pp x tp = 2 x 2 x 4 = 16"),
        ({"model.name": "gpt-small", "parallel.pp": 3}, 8, "world size 8 is not divisible by pp x tp = 3 x 1 = 3"),
        ({"model.name": "gpt-tiny", "parallel.pp": 8, "parallel.microbatches": 8}, 8,
         "model 'gpt-tiny' has 4 pipeline layers, fewer than stages x virtual stages = 8"),
        ({"model.name": "gpt-tiny", "parallel.pp": 4, "parallel.schedule": "interleaved-1f1b",
          "parallel.virtual_stages": 2, "parallel.microbatches": 4}, 4,
         "model 'gpt-tiny' has 4 pipeline layers, fewer than stages x virtual stages = 8"),
        ({"model.name": "gpt-tiny", "parallel.tp": 8}, 8, "n_head (4) must be divisible by tp (8)"),
        ({"model.name": "gpt-tiny", "parallel.tp": 4, "model.d_mlp": 254}, 4, "d_mlp (254) must be divisible by tp (4)"),
        ({"model.name": "gpt-small", "parallel.pp": 4, "parallel.schedule": "interleaved-1f1b",
          "parallel.virtual_stages": 2, "parallel.microbatches": 6}, 4,
         "interleaved-1f1b needs microbatches to be a multiple of the stages (4): got 6"),
        ({"model.name": "gpt-small", "parallel.pp": 4, "parallel.microbatches": 2}, 4,
         "1f1b needs at least as many microbatches (2) as stages (4); use --schedule gpipe for fewer"),
        ({"model.name": "gpt-small", "parallel.pp": 2, "parallel.microbatches": 4, "data.global_batch": 20}, 4,
         "data.global_batch 20 is not divisible by dp x microbatches = 2 x 4 = 8"),
        ({"model.name": "cnn", "parallel.pp": 2, "parallel.microbatches": 2}, 2,
         "model 'cnn' cannot be split into pipeline stages"),
        ({"model.name": "mlp", "parallel.tp": 2}, 2, "tensor parallelism shards language models (GPT, Llama, FILE.py:FUNCTION with a plan); 'mlp' is not one"),
        ({"model.name": "gpt-tiny", "parallel.tp": 2, "parallel.dp_mode": "torch"}, 2,
         "torch-ddp works with data parallelism alone (pp = tp = 1)"),
        ({"model.name": "gpt-tiny", "parallel.precision": "fp8"}, 2, "parallel.precision: unknown value 'fp8'"),
    ],
)
def test_each_bad_mesh_or_schedule_is_reported_with_its_message(overrides, world_size, message):
    found = problems(world_size, **overrides)
    assert any(message in line for line in found), found


def test_train_rejects_a_bad_mesh_before_any_rank_starts():
    result = CliRunner().invoke(main, ["train", "--model", "gpt-tiny", "--nproc", "8", "--pp", "4",
                                       "--microbatches", "2", "--tp", "8"])
    assert result.exit_code == 2
    assert "error: 1f1b needs at least as many microbatches (2) as stages (4)" in result.output
    assert "error: world size 8 is not divisible by pp x tp = 4 x 8 = 32" in result.output


def test_plan_only_prints_the_seed_model_and_memory_without_training():
    result = CliRunner().invoke(main, ["train", "--model", "gpt-seed", "--tp", "2", "--pp", "4",
                                       "--schedule", "1f1b", "--microbatches", "8", "--plan-only"])
    assert result.exit_code == 0, result.output
    assert "gpt-seed: 204,746,752 parameters" in result.output
    assert "world 8 = dp 1 x pp 4 x tp 2" in result.output
    assert "memory per rank" in result.output and "Stage 3:" in result.output


def test_check_passes_a_correct_pipeline_and_fails_an_impossible_tolerance():
    args = ["check", "--model", "gpt-tiny", "--pp", "2", "--schedule", "1f1b", "--microbatches", "2",
            "--global-batch", "8", "--steps", "2"]
    passed = CliRunner().invoke(main, args)
    assert passed.exit_code == 0, passed.output
    assert "PASS" in passed.output and "largest loss difference" in passed.output
    failed = CliRunner().invoke(main, args + ["--param-atol", "0", "--loss-rtol", "0"])
    assert failed.exit_code == 1 and "FAIL" in failed.output


def test_the_training_pages_example_config_and_error_lines_are_what_runs():
    """docs/training.md's `--config examples/run.yaml` names a file that exists and validates (its
    plan printed, nothing trained), and the page's error lines are what the command prints."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "training.md").read_text()
    assert ".venv/bin/paratrain train --config examples/run.yaml --lr 0.01" in page
    result = CliRunner().invoke(main, ["train", "--config", str(root / "examples" / "run.yaml"), "--lr", "0.01",
                                       "--plan-only"])
    assert result.exit_code == 0, result.output
    assert "world 4 = dp 2 x pp 1 x tp 2" in result.output
    shown = re.search(r"\$ paratrain train --nproc 4 --global-batch 30 --lr -1\n(.*?)```", page, re.S).group(1)
    printed = CliRunner().invoke(main, ["train", "--nproc", "4", "--global-batch", "30", "--lr", "-1"]).output
    assert shown.strip().splitlines() == printed.strip().splitlines()


def test_the_summary_says_where_a_resumed_runs_first_loss_comes_from(capsys):
    """After a resume the first loss of this run is not the first of training: it says so."""
    from paratrain.train.cli import print_summary

    common = {"final_loss": 1.5, "step_ms": 10.0, "step_ms_stdev": 1.0, "compute_ms": 8.0, "comm_ms": 2.0,
              "exposed_comm_ms": 1.0, "samples_per_s": 100.0}
    print_summary({**common, "first_loss": 2.5, "first_step": 0})
    print_summary({**common, "first_loss": 2.0, "first_step": 6})
    fresh, resumed = [line for line in capsys.readouterr().out.splitlines() if "final loss" in line]
    assert fresh.endswith("1.50000 (from 2.50000)")
    assert resumed.endswith("1.50000 (from 2.00000 at step 6, where this run resumed)")

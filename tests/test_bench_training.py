"""Smoke tests of `paratrain bench ddp` and `paratrain bench scaling`: tiny models, a few steps,
threads. They check what the commands report and how they refuse bad input, never speed."""

import json

import pytest
from click.testing import CliRunner

from paratrain.bench.cli import bench
from paratrain.bench.ddp import JSON_KEYS as DDP_KEYS
from paratrain.bench.scaling import JSON_KEYS as SCALING_KEYS

FAST = ["--launcher", "threads", "--steps", "2", "--warmup", "1"]


def invoke(*args):
    return CliRunner().invoke(bench, [str(a) for a in args])


def test_bench_ddp_reports_every_mode_with_its_ratio_to_torch(tmp_path):
    out = tmp_path / "ddp.json"
    result = invoke("ddp", *FAST, "--models", "mlp,cnn-tiny", "--repeats", "1", "--batch-size", "8",
                    "--json", out)
    assert result.exit_code == 0, result.output
    assert "vs torch" in result.output and "comm share" in result.output
    # threads: ours on the fabric, PyTorch's on gloo -- the table must say so
    assert "ours) communicate over the in-process fabric, PyTorch's DDP over a gloo group" in result.output
    assert "its exposed_ms differs in method" in result.output
    records = json.loads(out.read_text())
    assert [(r["model"], r["mode"]) for r in records] == [
        (model, mode) for model in ("mlp", "cnn-tiny") for mode in ("naive", "ddp", "torch-ddp")
    ]
    for record in records:
        assert set(record) == set(DDP_KEYS)
        assert record["world_size"] == 2 and record["global_batch"] == 16
        assert record["params"] > 0 and record["step_ms"] > 0
        assert record["ratio_to_torch"] == pytest.approx(
            record["step_ms"] / next(r["step_ms"] for r in records
                                     if r["model"] == record["model"] and r["mode"] == "torch-ddp"))
    assert all(r["ratio_to_torch"] == 1.0 for r in records if r["mode"] == "torch-ddp")


def test_bench_ddp_without_torch_has_no_ratio_and_keeps_the_median_repeat(tmp_path):
    out = tmp_path / "ddp.json"
    result = invoke("ddp", *FAST, "--models", "mlp", "--modes", "ddp", "--repeats", "3", "--json", out)
    assert result.exit_code == 0, result.output
    (record,) = json.loads(out.read_text())
    assert record["ratio_to_torch"] is None
    assert record["step_ms"] == sorted(record["repeat_step_ms"])[1]


def test_bench_scaling_measures_both_modes_against_one_rank(tmp_path):
    out, plot = tmp_path / "scaling.json", tmp_path / "scaling.png"
    result = invoke("scaling", *FAST, "--max-nproc", "2", "--batch-size", "8", "--global-batch", "16",
                    "--json", out, "--plot", plot)
    assert result.exit_code == 0, result.output
    assert "CPU cores" in result.output and "efficiency = t1/tN" in result.output
    records = json.loads(out.read_text())
    assert [(r["mode"], r["world_size"]) for r in records] == [
        ("weak", 1), ("weak", 2), ("strong", 1), ("strong", 2)]
    for record in records:
        assert set(record) == set(SCALING_KEYS)
    weak1, weak2, strong1, strong2 = records
    assert weak1["speedup"] == weak1["efficiency"] == strong1["speedup"] == 1.0
    assert (weak2["batch_per_rank"], weak2["global_batch"]) == (8, 16)
    assert (strong2["batch_per_rank"], strong2["global_batch"]) == (8, 16)
    assert weak2["efficiency"] == pytest.approx(weak1["iter_ms"] / weak2["iter_ms"])
    assert strong2["efficiency"] == pytest.approx(strong2["speedup"] / 2)
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("args, message", [
    (["scaling", "--max-nproc", "4", "--global-batch", "100"],
     "100 is not divisible by world size 3; strong scaling needs a multiple of 12"),
    (["scaling", "--nprocs", "1,two"], "'1,two' is not a comma-separated list of integers"),
    (["scaling", "--nprocs", "0,2"], "world sizes must be positive integers"),
    (["ddp", "--models", "cnn-tiny,resnet"], "unknown model 'resnet'; valid: mlp, cnn-tiny"),
    (["ddp", "--modes", "ddp,zero4"], "unknown mode 'zero4'; valid: naive, ddp, torch-ddp, torch, zero1"),
    (["ddp", "--modes", "local-sgd"], "unknown mode 'local-sgd'"),
    (["ddp", "--models", ","], "no model given"),
    (["ddp", "--batch-size", "0"], "0 is not in the range x>=1"),
])
def test_bad_input_is_refused_before_any_rank_starts(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())  # click may wrap long messages


def test_weak_scaling_alone_needs_no_divisible_global_batch(tmp_path):
    out = tmp_path / "weak.json"
    result = invoke("scaling", *FAST, "--mode", "weak", "--nprocs", "3", "--batch-size", "4",
                    "--global-batch", "100", "--json", out)
    assert result.exit_code == 0, result.output
    assert [r["world_size"] for r in json.loads(out.read_text())] == [1, 3]


def test_bench_ddp_sets_our_zero1_beside_pytorchs_zero_redundancy_optimizer(tmp_path):
    out = tmp_path / "zero.json"
    result = invoke("ddp", "--launcher", "processes", "--steps", "2", "--warmup", "1", "--models", "mlp",
                    "--modes", "zero1,torch-zero1", "--repeats", "1", "--json", out)
    assert result.exit_code == 0, result.output
    ours, theirs = json.loads(out.read_text())
    assert (ours["mode"], theirs["mode"]) == ("zero1", "torch-zero1")
    assert ours["ratio_to_torch"] == pytest.approx(ours["step_ms"] / theirs["step_ms"])
    refused = invoke("ddp", *FAST, "--models", "mlp", "--modes", "torch-zero1")
    assert refused.exit_code == 2 and "needs a default process group" in refused.output


def test_bench_tp_trains_the_same_model_as_pytorchs_dtensor_tensor_parallelism(tmp_path):
    """Same seeded weights and batches, our layers vs torch.distributed.tensor.parallel: the
    command fails (exit 1) if the losses differ beyond float rounding."""
    out = tmp_path / "tp.json"
    result = invoke("tp", "--nprocs", "2", "--steps", "3", "--warmup", "1", "--rounds", "1", "--n-layer", "2",
                    "--json", str(out))
    assert result.exit_code == 0, result.output
    row = next(line.split() for line in result.output.splitlines() if line.strip().startswith("2 "))
    ours_ms, torch_ms, ratio, loss_diff = map(float, row[1:])
    # the ratio is printed to 2 decimals: within half its last digit (and the times' own rounding)
    assert ours_ms > 0 and torch_ms > 0 and ratio == pytest.approx(ours_ms / torch_ms, abs=0.006)
    assert loss_diff <= 1e-4
    [record] = json.loads(out.read_text())
    assert (record["tp"], record["model"]) == (2, "gpt-tiny")
    assert record["ratio"] == pytest.approx(record["ours_ms"] / record["torch_ms"])


def test_train_benchmark_prints_throughput_flops_and_the_scaling_table():
    from paratrain.cli import main

    result = CliRunner().invoke(main, ["train", "--model", "mlp", "--benchmark", "--max-nproc", "2", "--steps", "3"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines() if line[:8].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2] and [int(r[2]) for r in rows] == [32, 64]  # batch per replica fixed
    for world, _, _, step_ms, samples_s, _, gflop_s, per_rank, speedup, efficiency in rows:
        # both columns are printed to 2 decimals: allow their rounding (half a unit each, times world)
        rounding = 0.005 * (1 + int(world))
        assert float(step_ms) > 0 and float(gflop_s) == pytest.approx(float(per_rank) * int(world), rel=0.02,
                                                                        abs=rounding)
        assert float(efficiency) == pytest.approx(float(speedup) / int(world), abs=0.01)
    refused = CliRunner().invoke(main, ["train", "--model", "mlp", "--max-nproc", "2"])
    assert refused.exit_code == 2 and "--max-nproc goes with --benchmark" in refused.output


def test_benchmark_flops_are_the_models_matmuls():
    """mlp: Linear(in, h) -> GELU -> Linear(h, classes) on B samples. Forward 2B(in*h + h*c);
    backward: both weight gradients, and the input gradient of the second layer only."""
    from paratrain.models import model_config
    from paratrain.plan.flops import step_flops
    from paratrain.plan.shapes import GPTShape
    from paratrain.bench.train import flops_per_step
    from paratrain.train.config import TrainConfig, apply_overrides

    config = apply_overrides(TrainConfig(), {"model.name": "mlp", "data.global_batch": 32})
    m = model_config("mlp")
    B, i, h, c = 32, m.in_dim, m.hidden, m.classes
    assert flops_per_step(config) == 2 * B * (i * h + h * c) + 2 * B * (i * h + h * c) + 2 * B * h * c
    gpt = apply_overrides(TrainConfig(), {"model.name": "gpt-tiny", "data.global_batch": 8})
    assert flops_per_step(gpt) == step_flops(GPTShape.from_config(model_config("gpt-tiny")), 8)


def test_bench_ddp_times_our_fsdp_against_pytorch_fsdp2_and_our_ddp(tmp_path):
    out = tmp_path / "fsdp.json"
    result = invoke("ddp", "--launcher", "processes", "--steps", "2", "--warmup", "1", "--models", "gpt-tiny",
                    "--modes", "ddp,zero2,fsdp,torch-fsdp", "--repeats", "1", "--batch-size", "2", "--json", out)
    assert result.exit_code == 0, result.output
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert rows["fsdp"]["ratio_to_torch"] == pytest.approx(rows["fsdp"]["step_ms"] / rows["torch-fsdp"]["step_ms"])
    assert rows["fsdp"]["ratio_to_ddp"] == pytest.approx(rows["fsdp"]["step_ms"] / rows["ddp"]["step_ms"])
    assert rows["zero2"]["ratio_to_torch"] is None  # its peer, PyTorch's ZeRO-1, was not run
    assert rows["fsdp"]["comm_ms"] > 0

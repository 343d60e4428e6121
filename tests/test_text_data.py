"""Byte-level text: batches are a pure function of (seed, step, batch size) and stay inside their
split, bad inputs fail in one line before any rank starts, a GPT learns the shipped text,
evaluation reports a validation loss without changing training, and sampling is repeatable.

Validation-loss parity across layouts: 1e-5 relative, as for training losses in
test_parallel_3d.py (only the order of floating-point sums differs)."""

from __future__ import annotations

import importlib.resources
import re
import sys
import types

import pytest
import torch
from click.testing import CliRunner

from paratrain import run
from paratrain.cli import main
from paratrain.data import build_dataset, shard
from paratrain.data.text import SHIPPED_TEXT
from paratrain.models import build_model
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.sample import generate
from paratrain.train.setup import dataset_for
from paratrain.train.validate import problems_with

VAL_RTOL = 1e-5


@pytest.fixture
def two_part_file(tmp_path):
    """900 training bytes of value 1 but the last, 3; then 100 validation bytes of value 2
    (the last 10%)."""
    path = tmp_path / "parts.txt"
    path.write_bytes(bytes([1]) * 899 + bytes([3]) + bytes([2]) * 100)
    return path


def text_config(**overrides) -> TrainConfig:
    base = {"model.name": "gpt-tiny", "data.name": "text", "steps": 6, "log_every": 1000, "data.global_batch": 16}
    return apply_overrides(TrainConfig(), {**base, **overrides})


def losses_of(config: TrainConfig, world_size: int = 2):
    return run(train_rank, world_size, launcher="threads", args=(config,))[0]["log"]


def test_shipped_text_is_found_through_the_package():
    resource = importlib.resources.files("paratrain.data") / "texts" / SHIPPED_TEXT.name
    assert resource.is_file() and resource.read_bytes()[:7] == b"HAMLET,"
    assert 100_000 < SHIPPED_TEXT.stat().st_size < 2_000_000


def test_batches_depend_only_on_seed_step_and_batch_size():
    data, rebuilt = build_dataset("text", 3, block_size=32), build_dataset("text", 3, block_size=32)
    for step in range(3):
        data.global_batch(step, 8)  # what was drawn before must not matter
    inputs, targets = data.global_batch(5, 8)
    assert inputs.shape == targets.shape == (8, 32) and inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs, rebuilt.global_batch(5, 8)[0])
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert not torch.equal(inputs, data.global_batch(6, 8)[0])
    assert not torch.equal(inputs, build_dataset("text", 4, block_size=32).global_batch(5, 8)[0])


def test_each_rank_keeps_its_shard_of_the_same_global_batch():
    whole = build_dataset("text", 0, block_size=16).global_batch(2, 12)
    for world in (2, 3, 4):
        parts = [shard(build_dataset("text", 0, block_size=16).global_batch(2, 12), r, world) for r in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
        assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])


def test_training_windows_never_read_validation_bytes(two_part_file):
    data = build_dataset("text", 0, path=str(two_part_file), block_size=8)
    last_train_byte_read = False
    for step in range(200):
        inputs, targets = data.global_batch(step, 64)
        assert (inputs != 2).all() and (targets != 2).all(), f"step {step} read validation bytes"
        last_train_byte_read |= bool((targets == 3).any())
    assert last_train_byte_read  # windows reach the split's end, not short of it
    for inputs, targets in data.validation_batches(batch_size=4, max_batches=100):
        assert (inputs == 2).all() and (targets == 2).all()


def test_validation_batches_are_fixed_windows_that_wrap_round(tmp_path):
    path = tmp_path / "counting.txt"
    path.write_bytes(bytes(range(200)) * 5)  # 1000 bytes: validation = bytes 900..999
    data = build_dataset("text", 0, path=str(path), block_size=10)
    batches = data.validation_batches(batch_size=4, max_batches=5)
    again = data.validation_batches(batch_size=4, max_batches=5)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    # (100 - 1) // 10 = 9 windows, 10 bytes apart: 3 batches of 4, the last wrapping to window 0.
    assert len(batches) == 3
    firsts = torch.cat([inputs[:, 0] for inputs, _ in batches]).tolist()
    expected = [(900 + 10 * (w % 9)) % 200 for w in range(12)]
    assert firsts == expected
    assert len(data.validation_batches(batch_size=4, max_batches=2)) == 2


@pytest.mark.parametrize(
    "options, message",
    [
        ({"path": "/nonexistent/book.txt"}, "text file /nonexistent/book.txt does not exist"),
        ({"block_size": 200}, "is too short: 1000 bytes give 900 for training and 100 for validation"),
        ({"vocab_size": 128}, "byte-level text needs a GPT with vocab_size >= 256, got 128; use a model with vocab 256+"),
    ],
)
def test_bad_text_inputs_fail_with_one_line(two_part_file, options, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        build_dataset("text", 0, **{"path": str(two_part_file), **options})
    assert "\n" not in str(error.value)


def test_text_is_refused_for_models_that_are_not_gpts():
    with pytest.raises(ValueError, match="model 'cnn' cannot train on text"):
        dataset_for("cnn", {}, "text", 0)
    with pytest.raises(ValueError, match=r"'tokens' data or on text \('text' or 'text:PATH'\) or a token file \('tokens:PATH'\), not 'digits'"):
        dataset_for("gpt-tiny", {}, "digits", 0)
    assert dataset_for("gpt-small", {}, "text", 0).block_size == 64  # vocab 512 is enough


def test_config_validation_checks_the_text_before_any_rank_starts(two_part_file):
    assert problems_with(text_config(), 2) == []
    assert problems_with(text_config(**{"data.name": f"text:{two_part_file}"}), 2) == []
    bad = problems_with(text_config(**{"data.name": "text:/nonexistent/book.txt", "eval_every": -1}), 2)
    assert bad == ["data.name: text file /nonexistent/book.txt does not exist (or is not a file)",
                   "eval_every must be an integer >= 0, got -1"]
    result = CliRunner().invoke(main, ["train", "--model", "gpt-tiny", "--data", "text:/nonexistent/book.txt"])
    assert result.exit_code == 2
    assert "error: data.name: text file /nonexistent/book.txt does not exist" in result.output


def test_gpt_tiny_learns_the_shipped_text():
    log = losses_of(text_config(**{"steps": 12, "eval_every": 11}))
    assert log[-1]["loss"] < log[0]["loss"] - 1.0  # from ~ln 256 = 5.5 nats per byte
    assert log[-1]["val_loss"] < log[0]["val_loss"] - 1.0


@pytest.mark.parametrize("world_size, dropout", [(1, 0.1), (2, 0.0)])
def test_evaluation_leaves_training_losses_unchanged_and_logs_val_loss(world_size, dropout):
    """With dropout, a model left in eval mode or an evaluation drawing from the RNG would
    change the losses. (Threads share torch's RNG, so dropout runs on one rank only.)"""
    torch.manual_seed(0)
    plain = losses_of(text_config(**{"model.dropout": dropout}), world_size)
    torch.manual_seed(0)
    evaluated = losses_of(text_config(**{"model.dropout": dropout, "eval_every": 4}), world_size)
    assert [e["loss"] for e in evaluated] == [e["loss"] for e in plain]
    assert [e["step"] for e in evaluated if "val_loss" in e] == [0, 4, 5]  # every 4 and the last
    assert all("val_loss" not in e for e in plain)


def test_pipeline_and_tensor_parallel_evaluation_match_one_process():
    reference = losses_of(text_config(**{"eval_every": 5}), world_size=1)
    config = text_config(**{"eval_every": 5, "parallel.pp": 2, "parallel.tp": 2,
                            "parallel.microbatches": 2, "parallel.schedule": "1f1b"})
    parallel = losses_of(config, world_size=4)
    for ours, ref in zip(parallel, reference):
        assert ("val_loss" in ours) == ("val_loss" in ref)
        if "val_loss" in ref:
            assert abs(ours["val_loss"] - ref["val_loss"]) <= VAL_RTOL * ref["val_loss"], ours["step"]


def test_digits_evaluation_reports_loss_and_accuracy_over_the_held_out_images():
    config = apply_overrides(TrainConfig(), {"model.name": "cnn", "model.channels": (8, 16), "model.hidden": 32,
                                             "steps": 2, "eval_every": 1, "log_every": 1000})
    log = losses_of(config, world_size=2)  # 297 held-out images: the last batch splits unevenly
    assert all(0.0 <= e["val_accuracy"] <= 1.0 and e["val_loss"] > 0 for e in log)
    single = losses_of(config, world_size=1)
    assert abs(log[-1]["val_loss"] - single[-1]["val_loss"]) <= VAL_RTOL * single[-1]["val_loss"]
    assert log[-1]["val_accuracy"] == single[-1]["val_accuracy"]


def seeded_gpt(**overrides):
    torch.manual_seed(0)
    return build_model("gpt-tiny", **overrides)


def test_generate_is_repeatable_and_continues_the_prompt():
    model = seeded_gpt()
    rng_before = torch.get_rng_state()
    first = generate(model, "To be, or not", 24, temperature=0.8, top_k=40, seed=7)
    assert torch.equal(torch.get_rng_state(), rng_before)  # its own generator
    assert model.training  # the mode it had
    assert first == generate(model, "To be, or not", 24, temperature=0.8, top_k=40, seed=7)
    assert first != generate(model, "To be, or not", 24, temperature=0.8, top_k=40, seed=8)
    assert first.startswith("To be, or not") and len("To be, or not") < len(first) <= len("To be, or not") + 24
    assert generate(model, b"HAMLET.", 0) == "HAMLET."
    long_prompt = "x" * 100  # longer than block_size 64: the context is cropped
    assert generate(model, long_prompt, 5, seed=1).startswith(long_prompt)


def test_top_1_is_the_likeliest_byte():
    model = seeded_gpt()
    with torch.no_grad():
        model.eval()
        likeliest = int(model(torch.tensor([list(b"abc")]))[0, -1, :256].argmax())
    expected = bytes([97, 98, 99, likeliest]).decode("utf-8", errors="replace")
    assert generate(model, "abc", 1, top_k=1, seed=3) == expected


def test_generate_refuses_a_vocab_too_small_for_bytes():
    with pytest.raises(ValueError, match="vocab_size is 128: byte-level text needs 256"):
        generate(seeded_gpt(vocab_size=128), "hi", 5)


def fake_checkpoint_module(loader) -> types.ModuleType:
    module = types.ModuleType("paratrain.train.checkpoint")
    module.load_for_inference = loader
    return module


def test_sample_command_prints_a_continuation(monkeypatch):
    config, model = text_config(), seeded_gpt()
    loaded = []

    def load_for_inference(path):
        loaded.append(path)
        return config, model

    monkeypatch.setitem(sys.modules, "paratrain.train.checkpoint", fake_checkpoint_module(load_for_inference))
    args = ["sample", "--checkpoint", "ckpt/step-000200", "--prompt", "HAMLET.", "--max-new-tokens", "30",
            "--temperature", "0.8", "--top-k", "40", "--seed", "5"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert loaded == ["ckpt/step-000200"]
    assert result.output == generate(model, "HAMLET.", 30, 0.8, 40, 5) + "\n"


def test_sample_command_reports_a_missing_checkpoint_in_one_line(monkeypatch):
    def load_for_inference(path):
        raise FileNotFoundError(f"no checkpoint at {path}")

    monkeypatch.setitem(sys.modules, "paratrain.train.checkpoint", fake_checkpoint_module(load_for_inference))
    result = CliRunner().invoke(main, ["sample", "--checkpoint", "nowhere"])
    assert result.exit_code == 2
    assert result.output.strip() == "paratrain sample: error: no checkpoint at nowhere"


def test_a_numpy_token_file_trains_and_evaluates_at_dp2_tp2(tmp_path):
    """nanoGPT's format: a flat uint16 file of token ids, here written by numpy. The model's
    vocabulary is given on the command line (the file's ids reach 999)."""
    import numpy as np

    rng = np.random.default_rng(0)
    successors = rng.integers(0, 1000, (1000, 3))  # a walk with 3 successors per id: learnable
    ids = [0]
    for choice in rng.integers(0, 3, 20_000):
        ids.append(successors[ids[-1], choice])
    path = tmp_path / "train.bin"
    np.array(ids, dtype=np.uint16).tofile(path)
    metrics = tmp_path / "m.json"
    result = CliRunner().invoke(main, ["train", "--model", "gpt-tiny", "--vocab-size", "1024", "--data", f"tokens:{path}",
                                       "--dp", "2", "--tp", "2", "--steps", "8", "--eval-every", "7", "--optimizer",
                                       "adamw", "--lr", "0.003", "--metrics-out", str(metrics)])
    assert result.exit_code == 0, result.output
    summary = __import__("json").loads(metrics.read_text())["summary"]
    assert summary["final_loss"] < summary["first_loss"] - 0.3 and "val_loss" in summary
    too_far = CliRunner().invoke(main, ["train", "--model", "gpt-tiny", "--data", f"tokens:{path}", "--steps", "2"])
    assert too_far.exit_code == 2 and "is beyond the model's vocabulary of 256" in too_far.output
    assert len(too_far.output.strip().splitlines()) == 1, too_far.output

"""A user's own model (`--model FILE.py:FUNCTION --plan PLAN.yaml`): examples/own_model's decoder,
written without paratrain, checked at dp 2 x pp 2 x tp 2 with sequence parallelism against one
process by `paratrain check` (its fp32 tolerances: losses 1e-5 relative, parameters 1e-5), its
split printed by --plan-only, and the one-line errors for a model that cannot be loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from paratrain.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_model"
MODEL, PLAN = f"{EXAMPLE / 'model.py'}:build", str(EXAMPLE / "plan.yaml")


def paratrain(*args: str):
    return CliRunner().invoke(main, list(args))


def test_check_proves_the_example_model_trains_like_one_process_at_dp2_pp2_tp2():
    result = paratrain("check", "--model", MODEL, "--plan", PLAN, "--tp", "2", "--pp", "2", "--dp", "2",
                       "--microbatches", "4", "--global-batch", "16", "--steps", "3", "--sequence-parallel")
    assert result.exit_code == 0, result.output
    assert "PASS: same model as one process" in result.output


def test_plan_only_prints_the_split():
    result = paratrain("train", "--model", MODEL, "--plan", PLAN, "--tp", "2", "--pp", "2", "--microbatches", "2",
                       "--plan-only")
    assert result.exit_code == 0, result.output
    assert "blocks.*.attention.query     colwise: 4 module(s)" in result.output
    assert "pipeline chunk 0 (stage 0): 3 layer(s): before: embed; blocks.0; blocks.1" in result.output
    assert "pipeline chunk 1 (stage 1): 3 layer(s): blocks.2; blocks.3; after: final_norm, lm_head" in result.output


def write(tmp_path, text: str) -> str:
    path = tmp_path / "mine.py"
    path.write_text(text)
    return str(path)


NO_VOCAB = "from torch import nn\ndef build():\n    return nn.Linear(4, 4)\n"


@pytest.mark.parametrize("source, function, extra, message", [
    (None, "build", [], "model file {dir}/missing.py not found"),
    (NO_VOCAB, "make", [], "model file {dir}/mine.py has no function 'make'"),
    (NO_VOCAB, "build", [], "its vocab size is not an attribute of the module (vocab_size); give it with --vocab-size"),
    ("raise ImportError('no such thing')\n", "build", [], "model file {dir}/mine.py: ImportError: no such thing"),
    (NO_VOCAB, "build", ["--n-layer", "2"], "the function takes no option 'n_layer'; it takes: nothing"),
])
def test_a_model_file_that_does_not_load_is_one_line(tmp_path, source, function, extra, message):
    path = write(tmp_path, source) if source else str(tmp_path / "missing.py")
    result = paratrain("train", "--model", f"{path}:{function}", "--plan-only", *extra)
    assert result.exit_code == 2, result.output
    assert message.format(dir=tmp_path) in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_model_without_a_plan_cannot_be_split(tmp_path):
    result = paratrain("train", "--model", MODEL, "--tp", "2", "--plan-only")
    assert result.exit_code == 2
    assert f"model.plan: {MODEL} has no parallelism plan of its own; give one with --plan" in result.output

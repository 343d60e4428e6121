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


def test_the_readmes_config_builds_and_arguments_that_cannot_run_are_one_line(tmp_path):
    """examples/own_model/README.md's `model:` section, as written, plans; the same without its
    head count (6 does not divide a width of 128) used to end in a traceback from every rank."""
    import re

    section = re.search(r"`(model: \{name: examples/own_model/model\.py:build[^`]*)`", (EXAMPLE / "README.md").read_text())
    config = tmp_path / "run.yaml"
    config.write_text(section.group(1).replace("examples/own_model/model.py", str(EXAMPLE / "model.py")) + "\n")
    result = paratrain("train", "--config", str(config), "--plan-only")
    assert result.exit_code == 0, result.output
    config.write_text(f"model: {{name: {MODEL}, layers: 8, width: 128}}\n")
    result = paratrain("train", "--config", str(config), "--plan-only")
    assert result.exit_code == 2, result.output
    assert "with layers=8, width=128: one sequence of 64 tokens does not pass through it: RuntimeError: " \
           "shape '[1, 64, 6, -1]' is invalid" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_model_whose_logits_are_not_batch_position_vocabulary_is_one_line(tmp_path):
    source = ("import torch\nfrom torch import nn\n"
              "class Pooled(nn.Module):\n"
              "    vocab_size, block_size = 32, 8\n"
              "    def __init__(self):\n        super().__init__(); self.embed = nn.Embedding(32, 4); self.head = nn.Linear(4, 32)\n"
              "    def forward(self, tokens):\n        return self.head(self.embed(tokens).mean(1))\n"
              "def build():\n    return Pooled()\n")
    result = paratrain("train", "--model", f"{write(tmp_path, source)}:build", "--plan-only")
    assert result.exit_code == 2, result.output
    assert "(1, 8) token ids gave logits of shape (1, 32), not (1, 8, 32)" in result.output

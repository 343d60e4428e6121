"""transformers' causal LMs as `hf:FAMILY` models (models/hf_model.py, hf_adapters.py, hf_plans.py):
our adapter gives transformers' own logits, bit for bit (both run the same SDPA calls in the same
order), under transformers' parameter names; every rank draws the same weights from the seed;
`paratrain check` proves a tp x pp layout and a cp layout train the same model as one process (its
fp32 tolerances: losses 1e-5 relative, parameters 1e-5); what cannot run is one line; and
transformers stays out of `import paratrain`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.models import build_model, model_config
from paratrain.models.hf_model import FAMILIES
from paratrain.train.setup import build_seeded_model

# Skipped without transformers; imported where used, so collecting this file (in every test
# worker) does not import it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "hf"


def tiny(family: str) -> str:
    """examples/hf/FAMILY-tiny.json; a name with its variant (gpt2-tiny-untied) is that file."""
    return str(EXAMPLES / (f"{family}.json" if "-tiny" in family else f"{family}-tiny.json"))


def paratrain(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_adapter_gives_transformers_own_logits_under_its_names(family):
    from transformers import AutoModelForCausalLM

    config = model_config(f"hf:{family}", hf_config=tiny(family))
    torch.manual_seed(0)
    ours = build_model(f"hf:{family}", hf_config=tiny(family))
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(config.hf_config_object(), attn_implementation="sdpa")
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    idx_BT = torch.randint(0, config.vocab_size, (2, config.block_size))
    with torch.no_grad():
        assert torch.equal(ours(idx_BT), theirs(idx_BT, use_cache=False).logits)


def test_the_tiny_examples_are_the_families_defaults():
    for family, spec in FAMILIES.items():
        assert json.loads(Path(tiny(family)).read_text()) == {"model_type": spec.model_type, **spec.tiny}


def test_every_rank_draws_the_same_weights_from_the_seed():
    first, again, other = (build_seeded_model("hf:qwen2", {}, seed) for seed in (3, 3, 4))
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters()))
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)


@pytest.mark.parametrize("family, layout", [
    ("llama", ["--nproc", "4", "--tp", "2", "--pp", "2", "--microbatches", "4"]),
    ("gpt2", ["--nproc", "2", "--cp", "2"]),
    ("gpt2-tiny-untied", ["--nproc", "4", "--tp", "2", "--pp", "2", "--microbatches", "4"]),  # Conv1D split over tp
])
def test_check_proves_the_layout_trains_like_one_process(family, layout):
    result = paratrain("check", "--model", f"hf:{family.split('-')[0]}", "--hf-config", tiny(family), *layout, "--steps", "3",
                       "--global-batch", "8")
    assert result.exit_code == 0, result.output
    assert "PASS: same model as one process" in result.output


@pytest.mark.parametrize("args, message", [
    (["--model", "hf:qwen3", "--tp", "2"], "parallel.tp: hf:qwen3: its q_norm and k_norm weights are shared"),
    (["--model", "hf:gpt2", "--pp", "2", "--microbatches", "2"], "a parameter is used both before and after the blocks (tied embeddings?)"),
    (["--model", "hf:llama", "--tp", "2", "--sequence-parallel"], "sequence parallelism needs sequence_parallel"),
    (["--model", "hf:falcon"], "unknown Hugging Face family 'falcon' in 'hf:falcon'; valid: hf:llama"),
    (["--model", "hf:llama", "--hf-config", "/no/such.json"], "model hf:llama: cannot read /no/such.json"),
    (["--model", "hf:llama", "--n-layer", "3"], "transformers' LlamaConfig has no field 'n_layer'"),
    (["--model", "hf:gpt2", "--hf-config", tiny("llama")], "llama-tiny.json is a 'llama' config, not 'gpt2'"),
])
def test_what_cannot_run_is_one_line(args, message):
    result = paratrain("train", *args, "--nproc", "2", "--plan-only")
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_sliding_window_shorter_than_the_context_is_refused(tmp_path):
    config = tmp_path / "windowed.json"
    config.write_text(json.dumps({**json.loads(Path(tiny("mistral")).read_text()), "sliding_window": 16}))
    result = paratrain("train", "--model", "hf:mistral", "--hf-config", str(config), "--plan-only")
    assert result.exit_code == 2, result.output
    assert "sliding_window 16 is shorter than the context (64)" in result.output


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_without_transformers_an_hf_model_is_one_line_naming_the_extra():
    done = run_python("import sys; sys.modules['transformers'] = None\n"
                      "from paratrain.cli import main\n"
                      "main(['train', '--model', 'hf:llama', '--plan-only'])")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("paratrain train: error: model: Hugging Face models need transformers: "
                                   "pip install 'paratrain[hf]'")


def test_importing_paratrain_never_imports_transformers():
    done = run_python("import sys, paratrain, paratrain.cli, paratrain.models, paratrain.models.plans\n"
                      "print('transformers' in sys.modules)")
    assert done.stdout.strip() == "False", done.stderr

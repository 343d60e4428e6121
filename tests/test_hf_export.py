"""Weights out to Hugging Face and back in: a checkpoint of any layout exported with
`paratrain export --to hf` loads in transformers with our model's logits, and `--init-from` starts
a run at another layout from those weights.

Tolerance: 1e-5 on fp32 logits. The HF models run the same operations on the same weights
(our rotary convention is HF's Llama's, so q and k are not permuted); only the order of
floating-point sums may differ.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.models import model_config
from paratrain.models.user_model import language_model_shape
from paratrain.train.checkpoint import load_for_inference
from paratrain.train.hf_files import HfDirectory
from paratrain.train.hf_weights import NoHfFormat, format_for
from paratrain.train.setup import dataset_for

# Skipped without transformers; imported where used, so collecting this file (in every test
# worker) does not import it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
LOGITS_ATOL = 1e-5


def paratrain(*args: str) -> str:
    result = CliRunner().invoke(main, [*args])
    assert result.exit_code == 0, result.output
    return result.output


def refused(*args: str) -> str:
    """The one line a refused command prints."""
    result = CliRunner().invoke(main, [*args])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """llama-tiny trained 10 steps at tp 2 x pp 2, its checkpoint and its export."""
    folder = tmp_path_factory.mktemp("llama")
    paratrain("train", "--model", "llama-tiny", "--nproc", "4", "--tp", "2", "--pp", "2", "--microbatches", "4",
              "--steps", "10", "--save-dir", str(folder / "ckpt"))
    said = paratrain("export", str(folder / "ckpt"), "--to", "hf", str(folder / "hf"))
    assert said.splitlines() == [f"wrote {folder / 'hf' / 'model.safetensors'} (21 tensors, 0.53 MB)",
                                 f"wrote {folder / 'hf' / 'config.json'} (LlamaForCausalLM)"]  # a line per file
    return folder


def hf_logits_difference(checkpoint, hf_dir) -> float:
    """Largest |logit| difference between our model rebuilt from `checkpoint` and transformers'
    model loaded from `hf_dir`, on random full-length sequences."""
    import transformers

    _, ours = load_for_inference(str(checkpoint))
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    vocab_size, block_size = language_model_shape(ours)
    idx = torch.randint(0, vocab_size, (2, block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (ours(idx) - theirs.eval()(idx).logits).abs().max().item()


def test_a_tp_pp_llama_checkpoint_exports_to_transformers_with_our_logits(llama):
    assert json.loads((llama / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert hf_logits_difference(llama / "ckpt", llama / "hf") <= LOGITS_ATOL


@pytest.fixture(scope="module")
def sharded(llama):
    """The same checkpoint exported in shards of at most 100 kB, and what the export said."""
    said = paratrain("export", str(llama / "ckpt"), "--to", "hf", str(llama / "sharded"), "--max-shard-size", "100KB")
    return llama / "sharded", said


def test_a_sharded_export_holds_the_same_tensors_and_loads(llama, sharded):
    folder, said = sharded
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 6 and files[0] == "model-00001-of-00006.safetensors" and len(said.splitlines()) == 8
    assert not (folder / "model.safetensors").exists()
    whole, sharded = HfDirectory(llama / "hf"), HfDirectory(folder)
    assert whole.weight_map.keys() == sharded.weight_map.keys()
    names = list(whole.weight_map)
    for name, tensor in whole.read(names).items():
        assert torch.equal(sharded.read([name])[name], tensor), name
    assert hf_logits_difference(llama / "ckpt", folder) <= LOGITS_ATOL


def first_loss_of_our_model(checkpoint) -> float:
    """Our model rebuilt from the checkpoint, on the first batch a fresh run trains on."""
    config, model = load_for_inference(str(checkpoint))
    dataset = dataset_for(config.model.name, config.model.overrides, config.data.name, config.seed)
    inputs, targets = dataset.global_batch(0, config.data.global_batch)
    with torch.no_grad():
        return dataset.loss(model(inputs), targets).item()


def test_init_from_the_export_at_another_layout_starts_from_the_checkpoints_weights(llama, sharded):
    """tp 2 here, tp 2 x pp 2 when saved; each rank reads its tensors from the sharded files."""
    metrics = llama / "init-tp2.json"
    paratrain("train", "--model", "llama-tiny", "--nproc", "2", "--tp", "2", "--steps", "1",
              "--init-from", str(sharded[0]), "--metrics-out", str(metrics))
    first = json.loads(metrics.read_text())["log"][0]["loss"]
    assert first == pytest.approx(first_loss_of_our_model(llama / "ckpt"), rel=1e-6)


def test_check_with_init_from_matches_one_process_started_from_the_same_weights(llama):
    said = paratrain("check", "--model", "llama-tiny", "--nproc", "2", "--dp", "2", "--steps", "2",
                     "--init-from", str(llama / "hf"))
    assert "PASS" in said
    first = float(said.split("\n    0 ")[1].split()[0])
    assert first == pytest.approx(first_loss_of_our_model(llama / "ckpt"), rel=1e-6)


@pytest.mark.parametrize("yaml, architecture", [
    ("model: {name: gpt-tiny}", "GPT2LMHeadModel"),
    ("model: {name: moe-tiny, n_shared_experts: 0, rope_theta: 500000.0}", "MixtralForCausalLM"),
    ("model: {name: 'hf:gpt2'}", "GPT2LMHeadModel"),  # HF's names already: exported as they are
])
def test_gpt_an_moe_llama_and_an_hf_model_export_with_our_logits(tmp_path, yaml, architecture):
    (tmp_path / "run.yaml").write_text(yaml + "\n")
    paratrain("train", "--config", str(tmp_path / "run.yaml"), "--nproc", "1", "--steps", "2",
              "--save-dir", str(tmp_path / "ckpt"))
    paratrain("export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [architecture]
    assert hf_logits_difference(tmp_path / "ckpt", tmp_path / "hf") <= LOGITS_ATOL


def test_an_hf_llama_started_from_our_llamas_export_has_its_first_loss(llama, sharded):
    """transformers' own Llama, built from the exported config.json, reads the same weights."""
    metrics = llama / "init-hf-llama.json"
    paratrain("train", "--model", "hf:llama", "--hf-config", str(sharded[0] / "config.json"), "--nproc", "1",
              "--steps", "1", "--init-from", str(sharded[0]), "--metrics-out", str(metrics))
    first = json.loads(metrics.read_text())["log"][0]["loss"]
    assert first == pytest.approx(first_loss_of_our_model(llama / "ckpt"), rel=1e-6)


def test_an_moe_with_shared_experts_is_refused_in_one_line():
    with pytest.raises(NoHfFormat, match="shared experts .* does not export as Mixtral"):
        format_for("moe-tiny", model_config("moe-tiny"))


def test_export_refuses_in_one_line(llama, tmp_path, monkeypatch):
    ckpt = str(llama / "ckpt")
    assert "is not a checkpoint" in refused("export", str(tmp_path), "--to", "hf", str(tmp_path / "out"))
    (tmp_path / "file").write_text("")
    assert "cannot write" in refused("export", ckpt, "--to", "hf", str(tmp_path / "file" / "out"))
    assert "is not a size" in refused("export", ckpt, "--to", "hf", str(tmp_path / "out"), "--max-shard-size", "lots")
    paratrain("train", "--model", "mlp", "--nproc", "1", "--steps", "1", "--save-dir", str(tmp_path / "mlp"))
    assert "model 'mlp' has no Hugging Face format" in refused("export", str(tmp_path / "mlp"), "--to", "hf",
                                                               str(tmp_path / "out"))
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert "pip install 'paratrain[hf]'" in refused("export", ckpt, "--to", "hf", str(tmp_path / "out"))


def test_init_from_refuses_in_one_line(llama, tmp_path):
    hf = str(llama / "hf")
    assert "give one of them" in refused("train", "--model", "llama-tiny", "--init-from", hf,
                                         "--resume", str(llama / "ckpt"))
    assert "is not a Hugging Face model directory" in refused("train", "--model", "llama-tiny",
                                                              "--init-from", str(tmp_path))
    assert "hidden_size is 64, the model's is 128" in refused("train", "--model", "llama-small", "--init-from", hf)


def test_a_tied_models_other_name_reads_the_tensor_it_shares():
    """An exported tied model has no lm_head tensor (transformers ties it on load): the output's
    name reads the embedding's, so --init-from starts a tied model too."""
    from paratrain.train.config import TrainConfig, apply_overrides
    from paratrain.train.hf_init import tied_names

    tied = apply_overrides(TrainConfig(), {"model.name": "llama-tiny", "model.tie_embeddings": True})
    assert tied_names(tied) == {"output.weight": "tok_emb.weight"}
    assert tied_names(apply_overrides(TrainConfig(), {"model.name": "llama-tiny"})) == {}


def test_each_rank_reads_only_its_rows_of_a_split_tensor(llama, monkeypatch):
    """--init-from at tp 2: a column-parallel weight's rows, a row-parallel one's columns, read
    through safetensors' slices (reading a whole tensor fails here), equal to the whole tensor
    cut as the layers cut it."""
    from paratrain.parallel.tensor.layers import shard
    from paratrain.train.config import TrainConfig, apply_overrides
    from paratrain.train.hf_files import HfDirectory
    from paratrain.train.hf_init import checked_hf_directory
    from paratrain.train.hf_slices import Cut, read_local

    config = apply_overrides(TrainConfig(), {"model.name": "llama-tiny"})
    directory, fmt, ours = checked_hf_directory(str(llama / "hf"), config)
    whole = {name: fmt.from_hf(name, directory.read(fmt.hf_names(name)), ours[name])
             for name in ("layers.0.attn.wq.weight", "layers.0.attn.wo.weight")}

    def no_whole_reads(self, names):
        raise AssertionError(f"read whole: {names}")

    monkeypatch.setattr(HfDirectory, "read", no_whole_reads)
    for rank in range(2):
        column = read_local(directory, fmt, "layers.0.attn.wq.weight", Cut(tp=(0, 1, rank, 2)), ours["layers.0.attn.wq.weight"])
        row = read_local(directory, fmt, "layers.0.attn.wo.weight", Cut(tp=(1, 1, rank, 2)), ours["layers.0.attn.wo.weight"])
        assert torch.equal(column, shard(whole["layers.0.attn.wq.weight"], 0, rank, 2))
        assert torch.equal(row, shard(whole["layers.0.attn.wo.weight"], 1, rank, 2))

"""Mixture of experts in training: with expert parallelism (`--ep`) beside every other axis and
strategy, moe-tiny trains the same model as one process (the parity matrix's comparison: 1e-5
on losses, every parameter and the router's bias); the experts' tokens and dropped pairs are the
single process's; a checkpoint saved at ep 2 resumes at ep 1 and ep 4 with the same losses."""

import json

import pytest
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.train.matrix import MODELS, Layout, run_cell

VARIANTS = {  # moe-tiny's balance loss is weak (0.01); a strong one shows a wrong share of it
    "moe strong balance": {"model.name": "moe-tiny", "model.aux_loss_coef": 1.0},
    "moe bias capacity": {"model.name": "moe-tiny", "model.aux_loss_coef": 0.0, "model.bias_update_rate": 0.01,
                          "model.capacity_factor": 1.0},
    "moe bias only": {"model.name": "moe-tiny", "model.aux_loss_coef": 0.0, "model.bias_update_rate": 0.01},
    "moe sigmoid": {"model.name": "moe-tiny", "model.score_func": "sigmoid", "model.renormalize": False,
                    "model.bias_update_rate": 0.05, "model.capacity_factor": 1.25},
}
CELLS = [
    ("moe strong balance", "ddp", Layout("ep 2 x dp 2", 4, ep=2)),
    ("moe-tiny", "zero1", Layout("ep 2 x tp 2", 4, tp=2, ep=2)),
    ("moe-tiny", "fsdp", Layout("ep 2", 2, ep=2)),
    ("moe bias capacity", "naive", Layout("ep 2 x pp 2", 4, pp=2, ep=2)),
    ("moe sigmoid", "zero2", Layout("ep 4", 4, ep=4)),
    ("moe bias only", "ddp", Layout("ep 2 x cp 2", 4, cp=2, ep=2)),  # the balance loss is per sequence: not under cp
]


@pytest.mark.parametrize("model, strategy, layout", CELLS, ids=[f"{m}-{s}-{l.name}" for m, s, l in CELLS])
def test_experts_over_ep_ranks_train_the_same_model_as_one_process(model, strategy, layout, monkeypatch):
    for name, overrides in VARIANTS.items():
        monkeypatch.setitem(MODELS, name, overrides)
    record = run_cell(model, strategy, layout)
    assert record["status"] == "PASS", record


def _train(tmp_path, name, *flags):
    config = tmp_path / "moe.yaml"
    config.write_text("model:\n  name: moe-tiny\n  overrides: {capacity_factor: 1.0, bias_update_rate: 0.01}\n")
    metrics = tmp_path / f"{name}.json"
    result = CliRunner().invoke(main, ["train", "--config", str(config), "--steps", "4", "--log-every", "1",
                                       "--metrics-out", str(metrics), *flags])
    assert result.exit_code == 0, result.output
    return json.loads(metrics.read_text()), result.output


def test_the_experts_see_the_same_tokens_and_drop_the_same_pairs_as_one_process(tmp_path):
    one, _ = _train(tmp_path, "one", "--nproc", "1")
    spread, output = _train(tmp_path, "ep", "--nproc", "4", "--ep", "2")
    for single, parallel in zip(one["log"], spread["log"]):
        assert parallel["expert_tokens"] == single["expert_tokens"]
        assert parallel["dropped_pairs"] == single["dropped_pairs"] > 0
    assert "experts max/mean" in output and "pairs dropped over capacity" in output
    assert spread["summary"]["dropped_pairs"] == sum(entry["dropped_pairs"] for entry in one["log"])


def test_a_checkpoint_saved_at_ep_2_resumes_at_ep_1_and_ep_4_with_the_same_losses(tmp_path):
    """The experts are saved whole (each rank's slice gathered over ep), with their optimizer
    state and the router's bias: any ep continues where ep 2 stopped."""
    saved, _ = _train(tmp_path, "saved", "--nproc", "4", "--ep", "2", "--save-dir", str(tmp_path / "ckpt"),
                      "--save-every", "2")
    losses = [entry["loss"] for entry in saved["log"]]
    for flags in (["--nproc", "1"], ["--nproc", "4", "--ep", "4", "--zero", "1"]):
        resumed, _ = _train(tmp_path, "resumed", *flags, "--resume", str(tmp_path / "ckpt" / "step-000002"))
        assert [entry["loss"] for entry in resumed["log"]] == pytest.approx(losses[2:], rel=1e-5)


def test_expert_parallelism_is_refused_in_one_line_where_it_cannot_run():
    for flags, reason in [
        (["--model", "llama-tiny", "--nproc", "2", "--ep", "2"], "has none (moe-tiny"),
        (["--model", "moe-tiny", "--nproc", "2", "--ep", "2", "--dp-mode", "torch-ddp"], "cannot run with ep > 1"),
        (["--model", "moe-tiny", "--nproc", "4", "--ep", "3"], "ep (3) must divide dp x cp = 4"),
        (["--model", "moe-tiny", "--nproc", "2", "--tp", "2", "--sequence-parallel"], "not with a mixture of experts"),
        (["--model", "moe-tiny", "--nproc", "2", "--cp", "2"], "the balance loss is per sequence"),
    ]:
        result = CliRunner().invoke(main, ["check", *flags])
        assert result.exit_code == 2 and reason in result.output, (flags, result.output)

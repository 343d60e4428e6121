"""Context parallelism in training (`--cp`): each model the matrix knows, on cp ranks and with the
other axes, trains the same model as one process (the parity matrix's comparison and
tolerances: 1e-5 on losses and parameters), a checkpoint saved at cp 2 resumes at cp 1, and what
cannot run is refused in one line before any rank starts."""

import json

import pytest
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.train.matrix import Layout, run_cell

CELLS = [  # (model, strategy, layout): every model that splits sequences, each axis beside cp once
    ("llama-tiny", "ddp", Layout("cp 4", 4, cp=4)),
    ("gpt-tiny", "zero2", Layout("cp 2 x tp 2", 4, cp=2, tp=2, sp=True)),
    ("own model", "fsdp", Layout("cp 2 x dp 2", 4, cp=2)),
    ("llama-tiny tied", "naive", Layout("cp 2 x tp 2", 4, cp=2, tp=2)),
    ("llama-tiny", "zero1", Layout("cp 2 x pp 2", 4, cp=2, pp=2)),
]


@pytest.mark.parametrize("model, strategy, layout", CELLS, ids=[f"{m}-{s}-{l.name}" for m, s, l in CELLS])
def test_a_model_on_cp_ranks_trains_the_same_model_as_one_process(model, strategy, layout):
    record = run_cell(model, strategy, layout)
    assert record["status"] == "PASS", record


def test_a_checkpoint_saved_at_cp_2_resumes_at_cp_1_with_the_same_losses(tmp_path):
    """The parameters are whole on every cp rank: a cp 1 run continues where cp 2 stopped."""
    def train(*flags, metrics):
        result = CliRunner().invoke(main, ["train", "--model", "llama-tiny", "--steps", "4", "--log-every", "1",
                                           "--save-dir", str(tmp_path / "ckpt"), "--metrics-out", str(metrics), *flags])
        assert result.exit_code == 0, result.output
        return [entry["loss"] for entry in json.loads(metrics.read_text())["log"]]

    whole = train("--nproc", "2", "--cp", "2", "--save-every", "2", metrics=tmp_path / "a.jsonl")
    resumed = train("--nproc", "1", "--resume", str(tmp_path / "ckpt" / "step-000002"), metrics=tmp_path / "b.jsonl")
    assert len(whole) == 4 and resumed == pytest.approx(whole[2:], rel=1e-5)


@pytest.mark.parametrize("flags, said", [
    (["--model", "mlp", "--cp", "2"], "parallel.cp: context parallelism splits the sequences of language models"),
    (["--model", "llama-tiny", "--nproc", "4", "--cp", "4", "--block-size", "60"],
     "parallel.cp: the sequence length 60 must divide by 8"),
    (["--model", "gpt-tiny", "--cp", "2", "--local-sgd", "2"], "data parallelism local-sgd cannot run with cp > 1"),
    (["--model", "gpt-tiny", "--cp", "2", "--cp-method", "p2p"], "parallel.cp_method: unknown value 'p2p'"),
    (["--model", "examples/own_model/model.py:build", "--cp", "2"], "has no context_parallel section"),
])
def test_what_cannot_split_over_cp_is_refused_in_one_line(flags, said):
    result = CliRunner().invoke(main, ["train", "--nproc", "2", *flags])
    assert result.exit_code != 0 and said in result.output, result.output
    assert "Traceback" not in result.output


def test_cp_ranks_hold_their_share_of_the_activations_counted_from_what_autograd_saves(tmp_path):
    """`memory.activations_bytes`: the peak of the tensors saved for backward, per rank."""
    def activations(cp: int, block_size: int) -> int:
        metrics = tmp_path / f"cp{cp}-{block_size}.json"
        result = CliRunner().invoke(main, ["train", "--model", "llama-tiny", "--block-size", str(block_size),
                                           "--global-batch", "4", "--steps", "1", "--nproc", str(cp), "--cp", str(cp),
                                           "--metrics-out", str(metrics)])
        assert result.exit_code == 0, result.output
        assert "activations saved for backward" in result.output
        return max(json.loads(metrics.read_text())["summary"]["memory"]["activations_bytes"])

    alone, two, four = activations(1, 256), activations(2, 256), activations(4, 256)
    assert two <= 0.55 * alone and four <= 0.3 * alone, (alone, two, four)
    assert abs(activations(2, 512) - alone) <= 0.05 * alone  # the same tokens per rank: the same memory


def test_cp_method_auto_is_the_planners_choice_printed_before_any_rank_starts(tmp_path):
    """--plan-only prints the race between the ring and the all-gather; a run with `auto` trains
    with the method the banner names (the planner's cost model on the local profile)."""
    planned = CliRunner().invoke(main, ["train", "--model", "llama-tiny", "--nproc", "2", "--cp", "2",
                                        "--cp-method", "auto", "--plan-only"])
    assert planned.exit_code == 0, planned.output
    assert "context parallel, per layer and microbatch on profile cpu-2core" in planned.output
    assert "exposed: ring" in planned.output and "all-gather" in planned.output
    picked = planned.output.split("auto picks ")[1].split()[0]
    assert picked in ("ring", "allgather") and f"cp 2 ({picked}, zigzag)" in planned.output
    ran = CliRunner().invoke(main, ["train", "--model", "llama-tiny", "--nproc", "2", "--cp", "2", "--cp-method", "auto",
                                    "--steps", "2", "--metrics-out", str(tmp_path / "m.json")])
    assert ran.exit_code == 0, ran.output
    assert f"cp 2 ({picked}, zigzag)" in ran.output

"""`--log tensorboard:DIR`: rank 0 writes one event file whose every step's loss, read back with
TensorBoard's own reader, equals the JSON log's; a target that cannot be written is refused in
one line before any rank starts."""

import json

import pytest
from click.testing import CliRunner

from paratrain.cli import main

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="the hf extra: pip install 'paratrain[hf]'")


def test_every_steps_loss_in_tensorboard_equals_the_json_logs(tmp_path):
    logs, metrics = tmp_path / "tb", tmp_path / "metrics.json"
    result = CliRunner().invoke(main, ["train", "--model", "moe-tiny", "--nproc", "2", "--ep", "2", "--steps", "4",
                                       "--log", f"tensorboard:{logs}", "--metrics-out", str(metrics)])
    assert result.exit_code == 0, result.output
    files = list(logs.glob("events.out.tfevents.*"))
    assert len(files) == 1  # rank 0 alone writes
    events = event_accumulator.EventAccumulator(str(logs))
    events.Reload()
    log = json.loads(metrics.read_text())["log"]
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    assert losses == pytest.approx({entry["step"]: entry["loss"] for entry in log}, rel=1e-6)
    tags = set(events.Tags()["scalars"])
    assert {"train/lr", "time/step_ms", "time/exposed_comm_ms", "throughput/tokens_per_s", "experts/imbalance",
            "memory/peak_mib"} <= tags


@pytest.mark.parametrize("target, said", [
    ("tensorboard", "tensorboard needs a directory"),
    ("prometheus:x", "unknown target 'prometheus'"),
])
def test_a_log_target_that_cannot_be_written_is_refused_in_one_line(target, said):
    result = CliRunner().invoke(main, ["train", "--model", "gpt-tiny", "--steps", "1", "--log", target])
    assert result.exit_code == 2 and said in result.output

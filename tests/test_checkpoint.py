"""Checkpoints: resume gives the uninterrupted run's losses bit for bit, saves are atomic,
damage is reported, layouts change on resume, and a killed rank restarts the run.

The resume tests train 3 steps, saving after step 2; a second run resumes from that checkpoint
for the last step: its loss is a forward through the loaded weights, and its final weights follow
an update with the loaded optimizer state and LR schedule. In fp32 and the same layout, its loss
and final weights are the first run's exactly (==): the weights, the optimizer state and the LR
schedule are saved bit for bit, and the data depends only on (seed, step). In another layout
only the order of floating-point sums changes: 1e-6.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from paratrain import run
from paratrain.train.checkpoint import CheckpointError, CheckpointReader, complete_checkpoints, load_for_inference
from paratrain.train.config import ConfigError, TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.validate import validate

RESHARD_RTOL, RESHARD_ATOL = 1e-6, 1e-6
RESUMED_FROM = 2
SHORT_RUN = {"steps": RESUMED_FROM + 1, "checkpoint.every": RESUMED_FROM}  # the resume tests' runs


def train_and_return_state(group, config):
    return train_rank(group, config, return_state=True)


def make_config(save_dir, **overrides) -> TrainConfig:
    base = {"model.name": "mlp", "steps": 6, "log_every": 1000, "data.global_batch": 32,
            "checkpoint.dir": str(save_dir), "checkpoint.every": 3}
    return apply_overrides(TrainConfig(), {**base, **overrides})


def losses_of(results) -> list[float]:
    return [entry["loss"] for entry in results[0]["log"]]


def merged_state(results) -> dict:
    state = {}
    for result in results.values():
        state.update(result["state"])
    return state


def interrupted_and_resumed(tmp_path, world, resume_overrides=None, resume_world=None, **overrides):
    """(uninterrupted results, results of the run resumed from its first checkpoint)."""
    config = make_config(tmp_path, **overrides)
    whole = run(train_and_return_state, world, args=(config,))
    resumed_config = make_config(tmp_path, **{**overrides, **(resume_overrides or {})})
    resumed_config.checkpoint.resume = str(tmp_path / f"step-{config.checkpoint.every:06d}")
    resumed_config.checkpoint.dir = str(tmp_path / "after-resume")
    resumed = run(train_and_return_state, resume_world or world, args=(resumed_config,))
    return whole, resumed


# Pipelines with 2 microbatches: what a checkpoint holds does not depend on how a batch is split.
SAME_LAYOUT = [
    pytest.param(2, {"parallel.dp_mode": "ddp"}, id="dp2-ddp"),
    pytest.param(2, {"parallel.dp_mode": "naive"}, id="dp2-naive"),
    pytest.param(2, {"parallel.zero": 1, "optim.name": "adamw", "optim.lr": 0.01}, id="dp2-zero1-adamw"),
    pytest.param(2, {"model.name": "gpt-tiny", "parallel.tp": 2, "optim.name": "adamw", "optim.lr": 0.01},
                 id="tp2-adamw"),
    pytest.param(2, {"model.name": "gpt-tiny", "parallel.pp": 2, "parallel.schedule": "1f1b",
                     "parallel.microbatches": 2}, id="pp2-1f1b"),
    pytest.param(2, {"parallel.dp_mode": "torch"}, id="dp2-torch-ddp"),
    pytest.param(2, {"model.name": "gpt-tiny", "parallel.pp": 2, "parallel.schedule": "zb-v",
                     "parallel.microbatches": 2, "parallel.virtual_stages": 2}, id="pp2-zb-v"),
    pytest.param(4, {"model.name": "gpt-tiny", "parallel.pp": 2, "parallel.schedule": "interleaved-1f1b",
                     "parallel.microbatches": 2, "parallel.virtual_stages": 2}, id="dp2xpp2-interleaved"),
]


@pytest.mark.parametrize("world, overrides", SAME_LAYOUT)
def test_resume_gives_the_uninterrupted_losses_bit_for_bit(tmp_path, world, overrides):
    whole, resumed = interrupted_and_resumed(tmp_path, world, **SHORT_RUN, **overrides)
    assert [e["step"] for e in resumed[0]["log"]] == [2]
    assert losses_of(resumed) == losses_of(whole)[RESUMED_FROM:]
    for name, value in merged_state(whole).items():
        assert torch.equal(merged_state(resumed)[name], value), name


@pytest.fixture(scope="module")
def whole_on_processes(tmp_path_factory):
    """(save dir, results): 12 uninterrupted steps on 2 processes, a checkpoint every 3. The
    process tests below compare with it (process start-up costs seconds)."""
    save_dir = tmp_path_factory.mktemp("whole-on-processes")
    return save_dir, run(train_rank, 2, launcher="processes", args=(make_config(save_dir, steps=12),))


def test_resume_on_processes_gives_the_same_losses(tmp_path, whole_on_processes):
    save_dir, whole = whole_on_processes
    config = make_config(tmp_path, steps=12)
    config.checkpoint.resume = str(save_dir / "step-000006")  # kept: steps 6, 9 and 12
    resumed = run(train_rank, 2, launcher="processes", args=(config,))
    assert resumed[0]["log"][0]["step"] == 6
    assert losses_of(resumed) == losses_of(whole)[6:]


@pytest.mark.parametrize("saved, world, resumed_as, resumed_world", [
    pytest.param({}, 2, {}, 4, id="dp2-to-dp4"),
    pytest.param({"parallel.tp": 2}, 4, {"parallel.tp": 1}, 4, id="dp2xtp2-to-tp1"),
    pytest.param({"parallel.tp": 2}, 2, {"parallel.tp": 1, "parallel.pp": 2, "parallel.microbatches": 2}, 2,
                 id="tp2-to-pp2"),
])
def test_a_checkpoint_loads_into_another_layout(tmp_path, saved, world, resumed_as, resumed_world):
    overrides = {"model.name": "gpt-tiny", **SHORT_RUN, **saved}
    whole, resumed = interrupted_and_resumed(
        tmp_path, world, resume_overrides=resumed_as, resume_world=resumed_world, **overrides)
    # The first resumed loss is computed from the loaded weights before any update.
    assert losses_of(resumed) == pytest.approx(losses_of(whole)[RESUMED_FROM:], rel=RESHARD_RTOL)
    for name, value in merged_state(whole).items():
        assert torch.allclose(merged_state(resumed)[name], value, rtol=0, atol=RESHARD_ATOL), name


def test_the_single_device_model_comes_back_from_a_tp_pp_checkpoint(tmp_path):
    config = make_config(tmp_path, **{"model.name": "gpt-tiny", "parallel.tp": 2, "parallel.pp": 2,
                                      "parallel.microbatches": 2, "model.n_layer": 2, "steps": 2,
                                      "checkpoint.every": 2})
    whole = run(train_and_return_state, 4, args=(config,))
    loaded_config, model = load_for_inference(str(tmp_path))
    assert loaded_config.model.name == "gpt-tiny" and loaded_config.parallel.tp == 2
    for name, param in model.named_parameters():
        assert torch.equal(param, merged_state(whole)[name]), name


def test_keep_leaves_the_newest_checkpoints(tmp_path):
    config = make_config(tmp_path, **{"checkpoint.every": 1, "checkpoint.keep": 2})
    run(train_rank, 2, args=(config,))
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000005", "step-000006"]


def test_a_save_that_fails_halfway_leaves_the_last_checkpoint_loadable(tmp_path, monkeypatch):
    writes = {"count": 0}
    original = dcp.FileSystemWriter.write_data

    def fail_on_the_second_checkpoint(self, plan, planner):
        writes["count"] += 1
        if writes["count"] > 2:  # 2 ranks wrote step 3; the next save dies in the writer
            raise OSError(28, "No space left on device")
        return original(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", fail_on_the_second_checkpoint)
    with pytest.raises(CheckpointError, match=r"could not save step-000006: no space left on device \(.* MiB free where it writes, .*\); the last complete checkpoint is .*step-000003"):
        run(train_rank, 2, args=(make_config(tmp_path, **{"steps": 9}),))
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000003"]
    assert list(tmp_path.glob(".tmp-step-000006"))  # the broken save, never read
    monkeypatch.undo()
    resumed = make_config(tmp_path, **{"steps": 9, "checkpoint.resume": "latest"})
    results = run(train_rank, 2, args=(resumed,))
    assert results[0]["log"][0]["step"] == 3
    assert (tmp_path / "step-000009").is_dir() and not list(tmp_path.glob(".tmp-*"))


def _one_data_file(checkpoint: Path) -> Path:
    return next(checkpoint.glob("rank-00000/*.distcp"))


def test_a_truncated_or_corrupted_checkpoint_is_a_clear_error(tmp_path):
    run(train_rank, 2, args=(make_config(tmp_path),))
    checkpoint = tmp_path / "step-000006"
    data = _one_data_file(checkpoint)
    original = data.read_bytes()
    data.write_bytes(original[: len(original) // 2])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is \d+ bytes, \d+ when saved: truncated"):
        CheckpointReader(checkpoint)
    corrupted = bytearray(original)
    corrupted[len(corrupted) // 2] ^= 0xFF
    data.write_bytes(bytes(corrupted))
    with pytest.raises(CheckpointError, match="is corrupted"):
        CheckpointReader(checkpoint)
    (checkpoint / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json cannot be read"):
        CheckpointReader(checkpoint)


def test_resuming_another_model_says_which_setting_differs(tmp_path):
    run(train_rank, 2, args=(make_config(tmp_path, steps=3),))
    other = make_config(tmp_path, **{"model.name": "mlp16", "checkpoint.resume": "latest"})
    with pytest.raises(CheckpointError, match="saved with model.name = 'mlp', this run has 'mlp16'"):
        run(train_rank, 2, args=(other,))


@pytest.mark.parametrize("overrides, problem", [
    ({"checkpoint.dir": None, "checkpoint.every": 5}, "need --save-dir"),
    ({"checkpoint.max_restarts": 1}, "needs --launcher processes"),
    ({"parallel.local_sgd": 2}, "refused with local-sgd"),
    ({"parallel.compress": "topk:0.1"}, "error-feedback residuals"),
    ({"checkpoint.keep": 0}, "checkpoint.keep must be an integer >= 1"),
    ({"checkpoint.resume": "/nonexistent/ckpt"}, "is not a checkpoint"),
])
def test_bad_checkpoint_options_are_refused_before_any_rank_starts(tmp_path, overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        validate(make_config(tmp_path, **overrides), 2)


# ---- a rank killed under the processes launcher -------------------------------------------------


def train_and_die_once(group, config, after_step):
    """Rank 1 SIGKILLs itself once the checkpoint of `after_step` exists, on the first attempt
    only (an elastic restart sets TORCHELASTIC_RESTART_COUNT)."""
    if group.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        marker = Path(config.checkpoint.dir) / f"step-{after_step:06d}"

        def watch():
            while not marker.exists():
                time.sleep(0.002)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()
    return train_rank(group, config)


def test_a_killed_rank_fails_the_run_naming_it_and_its_signal(tmp_path):
    config = make_config(tmp_path, **{"steps": 12, "checkpoint.every": 2})
    started = time.perf_counter()
    with pytest.raises(RuntimeError) as failure:
        run(train_and_die_once, 2, launcher="processes", args=(config, 2), timeout=30)
    assert time.perf_counter() - started < 60
    message = str(failure.value)
    assert "rank 1" in message and "SIGKILL" in message, message


def test_with_max_restarts_a_killed_rank_resumes_and_finishes_like_an_uninterrupted_run(tmp_path, whole_on_processes):
    config = make_config(tmp_path / "restarted", **{"steps": 12, "checkpoint.every": 2})
    restarted = run(train_and_die_once, 2, launcher="processes", args=(config, 2), timeout=30, max_restarts=1)
    _, whole = whole_on_processes
    assert restarted[0]["log"][0]["step"] > 0  # the last attempt started from a checkpoint
    assert restarted[0]["summary"]["final_loss"] == whole[0]["summary"]["final_loss"]
    manifest = json.loads((complete_checkpoints(tmp_path / "restarted")[-1] / "manifest.json").read_text())
    assert manifest["step"] == 12


def test_a_full_disk_is_named_as_such_and_the_last_checkpoint_stays(tmp_path, monkeypatch):
    from collections import namedtuple

    from paratrain.train import checkpoint

    run(train_rank, 2, args=(make_config(tmp_path, steps=3),))  # a checkpoint at step 3

    def full(*args, **kwargs):  # what PyTorch's writer says when the disk fills
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3520 vs 3414")
    monkeypatch.setattr(dcp, "save", full)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: namedtuple("Usage", "total used free")(1 << 30, 1 << 30, 4096))
    with pytest.raises(CheckpointError, match=r"could not save step-000006: no space left on device \(0.0 MiB free "
                                              r".*; the last complete checkpoint is .*step-000003"):
        run(train_rank, 2, args=(make_config(tmp_path, **{"checkpoint.resume": "latest"}),))
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000003"]


def test_a_newer_checkpoint_without_its_manifest_is_named_when_an_older_one_is_resumed(tmp_path):
    from paratrain.train.checkpoint import resolve, skipped_checkpoints

    run(train_rank, 2, args=(make_config(tmp_path, steps=3),))
    (tmp_path / "step-000006" / "rank-00000").mkdir(parents=True)  # a save cut off before its manifest
    chosen = resolve("latest", str(tmp_path))
    assert chosen.name == "step-000003"
    assert skipped_checkpoints(chosen) == [
        f"skipped {tmp_path / 'step-000006'}: it has no manifest.json (its save did not finish)"]


def test_a_manifest_changed_after_it_was_written_is_refused(tmp_path):
    run(train_rank, 2, args=(make_config(tmp_path, steps=3),))
    path = complete_checkpoints(tmp_path)[-1] / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["scheduler"] = {**manifest["scheduler"], "last_epoch": 1}  # still valid JSON, all keys there
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest.json is corrupted"):
        CheckpointReader(path.parent)


def test_a_save_dir_another_node_cannot_see_is_named_in_one_line(tmp_path):
    """Rank 0 made the step's folder on its own disk: a rank of another node finds none there."""
    from types import SimpleNamespace

    from paratrain.train.checkpoint import save

    elsewhere = SimpleNamespace(rank=1, size=2, barrier=lambda: None)  # rank 0 is on another node
    with pytest.raises(CheckpointError, match=r"rank 1 cannot see .*\.tmp-step-000004, which rank 0 made: "
                                              r"--save-dir must be one folder every node sees"):
        save(elsewhere, tmp_path, 4, {"w": torch.zeros(2)}, {}, keep=3)

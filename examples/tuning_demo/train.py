"""Train the GT seed's GPT through paratrain's frontend: one client program, 8 workers.

    python examples/tuning_demo/train.py --small            # a minute on a 2-core CPU
    python examples/tuning_demo/train.py --config examples/tuning_demo/tp4_pp2.yaml --small
    GT_CONFIG=examples/tuning_demo/tp1_pp8.yaml python examples/tuning_demo/train.py --small

The program starts as many workers as its configuration names (PyTorch's elastic launcher
starts them; they stop when it exits), loads the configuration, builds the model inside its
signals (model.py), and trains: each step's microbatches go through the pipeline in the order
of a schedule from paratrain's `parallel/pipeline/schedules.py` (1F1B by default), then AdamW
steps on the workers. Each step prints the loss, the step time and the bubble the workers
measured (time not spent computing), beside the schedule's theoretical one.

With --small the model is paratrain's gpt-small and starts from the weights `paratrain train
--model gpt-small` starts from, on the same token batches: its losses are the ones `paratrain
train --model gpt-small --tp 2 --pp 4` prints (tests/test_frontend_demo.py checks it).
"""

from __future__ import annotations

import os
import sys
import time

import click

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import paratrain.frontend as gt  # noqa: E402
from model import SEED, SMALL, SignalGPT, stages_in, weights_from_paratrain  # noqa: E402
from paratrain.data import build_dataset  # noqa: E402
from paratrain.frontend import signals  # noqa: E402
from paratrain.parallel.pipeline.schedules import build_schedule  # noqa: E402
from paratrain.parallel.pipeline.simulate import simulate  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PRESETS = {"small": ("gpt-small", SMALL), "seed": ("gpt-seed", SEED)}


def workers_named(config: dict) -> int:
    return 1 + max(w for settings in config.values()
                   for w in (settings.get("shard") or {}).get("workers", settings.get("workers", [])))


def train(config, preset: str = "small", *, steps: int = 20, global_batch: int = 16, microbatches: int = 8,
          schedule: str = "1f1b", virtual_stages: int = 1, lr: float = 3e-3, seed: int = 0,
          init: str = "paratrain", overrides: dict | None = None, log=print) -> dict:
    """Train through the frontend; -> per-step losses, step times and measured bubbles."""
    from paratrain.train.setup import build_seeded_model

    raw = signals.load(config)
    model_name, shape = PRESETS[preset]
    overrides = overrides or {}
    shape = type(shape)(**{**shape.__dict__, **overrides})
    if not gt.connected():
        gt.gpu_workers(workers_named(raw))
    gt.load_config(raw)
    stages = stages_in(raw)
    pipeline = build_schedule(schedule, stages, microbatches, virtual_stages=virtual_stages)
    weights = weights_from_paratrain(build_seeded_model(model_name, overrides, seed)) if init == "paratrain" else None
    model = SignalGPT(shape, stages, weights, virtual=pipeline.virtual_stages)
    optimizer = gt.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    dataset = build_dataset("tokens", seed, vocab_size=shape.vocab_size, block_size=shape.block_size)
    session = gt.session()
    theory = simulate(pipeline).bubble
    log(f"{model_name}: {sum(p.numel() for p in model.parameters()):,} parameters; {stages} stage(s) on "
        f"{session.n_workers} workers; {schedule}, {microbatches} microbatches of {global_batch // microbatches}")
    record = {"losses": [], "step_s": [], "bubble": [], "theoretical_bubble": theory}
    session.sync()
    before = dict(session.worker_stats)
    for step in range(steps):
        started = time.perf_counter()
        inputs, targets = dataset.global_batch(step, global_batch)
        with gt.signal.context("data"):
            micro_inputs = [gt.from_numpy(chunk.numpy()) for chunk in inputs.chunk(microbatches)]
        with gt.signal.context("targets"):
            micro_targets = [gt.from_numpy(chunk.numpy()) for chunk in targets.chunk(microbatches)]
        losses = gt.pipeline.run_step(pipeline, model.chunk_forward, model.stage_signal,
                                      micro_inputs, micro_targets, model.loss)
        optimizer.step()
        optimizer.zero_grad()
        loss = float(sum(value.item() for value in session.sync([l._handle for l in losses])))
        elapsed = time.perf_counter() - started
        after = dict(session.worker_stats)
        bubble = _measured_bubble(before, after, elapsed)
        before = after
        record["losses"].append(loss)
        record["step_s"].append(elapsed)
        record["bubble"].append(bubble)
        log(f"step {step + 1:3d}/{steps}  loss {loss:.4f}  step {elapsed * 1e3:7.0f} ms  "
            f"bubble {bubble:5.1%} (schedule: {theory:.1%})")
    return record


def _measured_bubble(before: dict, after: dict, elapsed: float) -> float:
    """Mean over workers of the share of the step not spent computing (waiting for another
    stage's tensor, or for instructions)."""
    shares = []
    for worker, now in after.items():
        then = before.get(worker, {"busy_s": 0.0, "wait_s": 0.0})
        computing = (now["busy_s"] - then["busy_s"]) - (now["wait_s"] - then["wait_s"])
        shares.append(max(0.0, 1.0 - computing / elapsed))
    return sum(shares) / len(shares) if shares else 0.0


@click.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              default=lambda: os.environ.get("PARATRAIN_CONFIG") or os.environ.get("GT_CONFIG")
              or os.path.join(HERE, "sharding_config.yaml"),
              help="Signal configuration (default: GT_CONFIG, or this folder's sharding_config.yaml: TP=2 x PP=4).")
@click.option("--small", is_flag=True, help="paratrain's gpt-small (8 layers, 128 wide) instead of the seed's 204.7M GPT.")
@click.option("--steps", default=20, show_default=True, type=click.IntRange(1))
@click.option("--global-batch", default=16, show_default=True, type=click.IntRange(1))
@click.option("--microbatches", default=8, show_default=True, type=click.IntRange(1))
@click.option("--schedule", default="1f1b", show_default=True, type=click.Choice(["gpipe", "1f1b", "interleaved-1f1b"]))
@click.option("--virtual-stages", default=2, show_default=True, type=click.IntRange(1),
              help="Chunks per stage for interleaved-1f1b.")
@click.option("--lr", default=3e-3, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
def main(config_path, small, steps, global_batch, microbatches, schedule, virtual_stages, lr, seed):
    """Train the seed's GPT through the frontend (TP=2 x PP=4 on 8 workers by default)."""
    if global_batch % microbatches:
        raise click.BadParameter(f"--global-batch {global_batch} must divide into {microbatches} microbatches")
    os.environ.pop("GT_CONFIG", None)  # the configuration is loaded explicitly below
    os.environ.pop("PARATRAIN_CONFIG", None)
    preset = "small" if small else "seed"
    record = train(config_path, preset, steps=steps, global_batch=global_batch, microbatches=microbatches,
                   schedule=schedule, virtual_stages=virtual_stages if schedule == "interleaved-1f1b" else 1,
                   lr=lr, seed=seed, init="paratrain" if small else "workers")
    times = sorted(record["step_s"][1:] or record["step_s"])
    click.echo(f"median step {times[len(times) // 2] * 1e3:.0f} ms; loss {record['losses'][0]:.4f} -> "
               f"{record['losses'][-1]:.4f}; mean bubble {sum(record['bubble']) / len(record['bubble']):.1%} "
               f"(schedule: {record['theoretical_bubble']:.1%})")


if __name__ == "__main__":
    main()

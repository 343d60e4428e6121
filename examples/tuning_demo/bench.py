"""The small demo's step time through the frontend beside `paratrain train` with the same mesh
and schedule, in one run: rounds alternate, and each reports the median step after the first.

    python examples/tuning_demo/bench.py                  # TP=2 x PP=4, 1F1B, 8 microbatches
    python examples/tuning_demo/bench.py --rounds 3 --steps 10 --launcher threads

Both train gpt-small from the same weights on the same batches (their losses are printed side by
side: they agree); `paratrain train` runs its 8 ranks as processes on gloo by default, as the
frontend's workers are.
"""

from __future__ import annotations

import os
import statistics
import sys

import click

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train import HERE, train  # noqa: E402

LAYOUTS = {"sharding_config.yaml": (2, 4), "tp4_pp2.yaml": (4, 2), "tp1_pp8.yaml": (1, 8)}


def paratrain_train(tp, pp, steps, global_batch, microbatches, schedule, lr, launcher) -> tuple[list, list]:
    """(losses, step seconds) of the SPMD `paratrain train` on the same model, data and optimizer."""
    from paratrain.launch import run
    from paratrain.train.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
    from paratrain.train.loop import train_rank

    config = TrainConfig(
        model=ModelConfig("gpt-small"), data=DataConfig(global_batch=global_batch),
        optim=OptimConfig("adamw", lr=lr, schedule="constant"), steps=steps, log_every=10**9,
        parallel=ParallelConfig(tp=tp, pp=pp, schedule=schedule, microbatches=microbatches, launcher=launcher))
    results = run(train_rank, tp * pp, launcher=launcher, args=(config,))
    log = results[min(results)]["log"]
    return [entry["loss"] for entry in log], [entry["step_ms"] / 1e3 for entry in log]


@click.command()
@click.option("--config", "config_name", default="sharding_config.yaml", type=click.Choice(sorted(LAYOUTS)))
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1))
@click.option("--steps", default=8, show_default=True, type=click.IntRange(2))
@click.option("--global-batch", default=16, show_default=True)
@click.option("--microbatches", default=8, show_default=True)
@click.option("--schedule", default="1f1b", show_default=True, type=click.Choice(["gpipe", "1f1b"]))
@click.option("--launcher", default="processes", show_default=True, type=click.Choice(["processes", "threads"]),
              help="How `paratrain train` runs its ranks.")
def main(config_name, rounds, steps, global_batch, microbatches, schedule, launcher):
    """Median step time: the frontend demo vs paratrain train, same mesh and schedule."""
    tp, pp = LAYOUTS[config_name]
    options = dict(steps=steps, global_batch=global_batch, microbatches=microbatches, schedule=schedule)
    ours, theirs = [], []
    for round_index in range(rounds):
        record = train(os.path.join(HERE, config_name), "small", lr=3e-3, log=lambda line: None, **options)
        losses, seconds = paratrain_train(tp, pp, steps, global_batch, microbatches, schedule, 3e-3, launcher)
        ours.append(statistics.median(record["step_s"][1:]))
        theirs.append(statistics.median(seconds[1:]))
        same = max(abs(a - b) / abs(b) for a, b in zip(record["losses"], losses))
        click.echo(f"round {round_index + 1}: frontend {ours[-1] * 1e3:6.0f} ms  paratrain train ({launcher}) "
                   f"{theirs[-1] * 1e3:6.0f} ms  ratio {ours[-1] / theirs[-1]:.2f}  (losses agree to {same:.1e})")
    click.echo(f"median over {rounds} rounds: frontend {statistics.median(ours) * 1e3:.0f} ms, paratrain train "
               f"{statistics.median(theirs) * 1e3:.0f} ms, ratio {statistics.median(ours) / statistics.median(theirs):.2f}")


if __name__ == "__main__":
    main()

"""`paratrain bench train` (also `paratrain train --benchmark`): what a training configuration
achieves on this machine.

It trains the configuration on its model's synthetic data (the numbers are about speed, not
learning) and prints throughput (samples/s, tokens/s) and achieved FLOP/s. With `--max-nproc N`
it repeats the run for every world size up to N that the layout allows (multiples of pp x tp,
more data-parallel replicas each time), keeping the batch per replica fixed, and prints the
scaling table of the book chapter: throughput, speedup and efficiency against the smallest world.

FLOPs per step: for a GPT, the model FLOPs of paratrain/plan/flops.py (forward + backward, the
matmuls and attention, no recomputation: the count MFU is based on); for the other models,
`torch.utils.flop_counter` counted on one forward and backward of the global batch.
"""

from __future__ import annotations

import copy

import click
from torch.utils.flop_counter import FlopCounterMode

from paratrain.bench.ddp import _quiet
from paratrain.launch import run
from paratrain.models import GPTConfig, model_config
from paratrain.plan.flops import step_flops
from paratrain.plan.shapes import GPTShape
from paratrain.environment import Settings
from paratrain.train.cli import describe_model, describe_run
from paratrain.train.config import TrainConfig
from paratrain.train.loop import train_rank
from paratrain.train.options import training_options, validated_config
from paratrain.train.setup import build_seeded_model, dataset_for


def flops_per_step(config: TrainConfig) -> float:
    shape = model_config(config.model.name, **config.model.overrides)
    if isinstance(shape, GPTConfig):
        return step_flops(GPTShape.from_config(shape), config.data.global_batch)
    model = build_seeded_model(config.model.name, config.model.overrides, config.seed)
    dataset = dataset_for(config.model.name, config.model.overrides, None, config.seed)
    inputs, targets = dataset.global_batch(0, config.data.global_batch)
    with FlopCounterMode(display=False) as counter:
        dataset.loss(model(inputs), targets).backward()
    return float(counter.get_total_flops())


def quiet_train_rank(group, config: TrainConfig) -> dict:
    """train_rank without its log lines and progress bar: the benchmark prints its own rows."""
    with _quiet(group.rank == 0):
        return train_rank(group, config)


def world_sizes(config: TrainConfig, world: int, max_nproc: int | None) -> list[int]:
    unit = config.parallel.pp * config.parallel.tp
    if not max_nproc:
        return [world]
    sizes = list(range(unit, max_nproc + 1, unit))
    if not sizes:
        raise click.UsageError(f"--max-nproc {max_nproc} is below one replica's pp x tp = {unit} ranks")
    return sizes


def benchmark(config: TrainConfig, world: int, max_nproc: int | None, settings: Settings) -> list[dict]:
    """One row per world size: step time, throughput, FLOP/s; printed as it goes."""
    per_replica = config.data.global_batch // (world // (config.parallel.pp * config.parallel.tp))
    rows = []
    click.echo(f"# {'world':>5}  {'dp':>3}  {'global batch':>12}  {'step_ms':>9}  {'samples/s':>10}  "
               f"{'tokens/s':>10}  {'GFLOP/s':>9}  {'per rank':>9}  {'speedup':>7}  {'efficiency':>10}")
    for size in world_sizes(config, world, max_nproc):
        run_config = copy.deepcopy(config)
        dp = size // (config.parallel.pp * config.parallel.tp)
        run_config.parallel.nproc, run_config.data.global_batch, run_config.data.name = size, per_replica * dp, None
        run_config.parallel.dp = None
        run_config.checkpoint.dir, run_config.eval_every, run_config.log_every = None, 0, 10**9
        summary = run(quiet_train_rank, size, launcher=config.parallel.launcher, args=(run_config,),
                      timeout=config.parallel.timeout, settings=settings)[0]["summary"]
        flop_s = flops_per_step(run_config) / (summary["step_ms"] / 1e3)
        row = {"world": size, "dp": dp, "global_batch": run_config.data.global_batch, "step_ms": summary["step_ms"],
               "samples_per_s": summary["samples_per_s"], "tokens_per_s": summary.get("tokens_per_s"),
               "flop_s": flop_s}
        base = rows[0] if rows else row
        row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
        row["efficiency"] = row["speedup"] / (size / base["world"])
        rows.append(row)
        tokens = f"{row['tokens_per_s']:>10,.0f}" if row["tokens_per_s"] else f"{'-':>10}"
        click.echo(f"  {size:>5}  {dp:>3}  {row['global_batch']:>12}  {row['step_ms']:>9.1f}  "
                   f"{row['samples_per_s']:>10,.0f}  {tokens}  {flop_s / 1e9:>9.2f}  {flop_s / size / 1e9:>9.2f}  "
                   f"{row['speedup']:>7.2f}  {row['efficiency']:>10.2f}")
    click.echo("# step_ms: mean over the timed steps (the first left out); speedup: throughput over the "
               "smallest world's; efficiency: speedup / (world / smallest world); batch per replica fixed")
    click.echo("# GFLOP/s: model FLOPs per step (forward + backward) / step time; per rank: divided by the world")
    return rows


@click.command("train", context_settings={"help_option_names": ["-h", "--help"]})
@training_options
@click.option("--max-nproc", type=click.IntRange(min=1),
              help="Every world size up to this (multiples of pp x tp), batch per replica fixed.")
def train(config_path, max_nproc, **flags):
    """Measure a training configuration instead of training it: synthetic data, throughput and
    achieved FLOP/s (with --max-nproc, for every world size up to it: the scaling table).
    Takes the options of `paratrain train`.

    \b
    Example:
      paratrain bench train --model gpt-tiny --max-nproc 4 --steps 10
    """
    settings = Settings.resolve()
    if settings.launch.in_torchrun:
        raise click.UsageError("the training benchmark starts its own worlds: run it without torchrun")
    config, world = validated_config(config_path, flags, settings)
    click.echo(describe_model(config))
    for line in describe_run(config, world, settings):
        click.echo(line)
    click.echo(f"# paratrain bench train: {config.model.name}, {config.steps} steps per world size, "
               f"launcher {config.parallel.launcher}")
    benchmark(config, world, max_nproc, settings)

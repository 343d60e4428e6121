"""`paratrain train`: configuration from YAML and flags, validated, then a world of ranks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from paratrain.launch import in_torchrun, run
from paratrain.models import count_parameters, format_count, gpt_parameter_count, model_config
from paratrain.train.config import ConfigError, TrainConfig, to_dict
from paratrain.train.loop import train_rank
from paratrain.train.options import build_config, training_options, world_size_of
from paratrain.train.validate import validate


def describe_model(config: TrainConfig) -> str:
    model = model_config(config.model.name, **config.model.overrides)
    if hasattr(model, "n_layer"):
        params = gpt_parameter_count(model)
    else:
        from paratrain.train.setup import build_seeded_model

        params = count_parameters(build_seeded_model(config.model.name, config.model.overrides, config.seed))
    return f"{config.model.name}: {params:,} parameters ({format_count(params)})"


def print_summary(summary: dict) -> None:
    rows = [
        ("final loss", f"{summary['final_loss']:.5f} (from {summary['first_loss']:.5f})"),
        ("step time", f"{summary['step_ms']:.1f} ms (stdev {summary['step_ms_stdev']:.1f})"),
        ("compute", f"{summary['compute_ms']:.1f} ms"),
        ("communication", f"{summary['comm_ms']:.1f} ms in all, {summary['exposed_comm_ms']:.1f} ms not hidden"),
        ("throughput", f"{summary['samples_per_s']:,.0f} samples/s"
         + (f", {summary['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in summary else "")),
    ]
    click.echo("summary (means over steps after the first):")
    for name, value in rows:
        click.echo(f"  {name:14s} {value}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@training_options
def train(config_path, **flags):
    """Train a model on a world of ranks with data parallelism.

    \b
    Examples:
      paratrain train --model mlp --nproc 4 --dp-mode ddp --steps 100
      paratrain train --model cnn --channels 32 64 128 --hidden 512 --launcher processes
      torchrun --nproc-per-node 4 -m paratrain train --model mlp16
    """
    try:
        config = build_config(config_path, flags)
        world = world_size_of(config)
        validate(config, world)
    except ConfigError as error:
        for problem in error.problems:
            click.echo(f"error: {problem}", err=True)
        sys.exit(2)
    leader = not in_torchrun() or os.environ.get("RANK") == "0"
    if leader:
        click.echo(describe_model(config))
        par = config.parallel
        click.echo(
            f"world {world} ({'torchrun' if in_torchrun() else par.launcher}), dp-mode {par.dp_mode}, "
            f"global batch {config.data.global_batch} ({config.data.global_batch // world} per rank"
            + (f", {par.grad_accum} micro-batches" if par.grad_accum > 1 else "") + ")"
        )
    results = run(train_rank, config.parallel.nproc, launcher=config.parallel.launcher, args=(config,),
                  timeout=config.parallel.timeout, debug=config.parallel.debug or None)
    if 0 not in results:
        return
    result = results[0]
    print_summary(result["summary"])
    if config.metrics_out:
        path = Path(config.metrics_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"config": to_dict(config), **result}, indent=1))
        click.echo(f"metrics written to {path}")

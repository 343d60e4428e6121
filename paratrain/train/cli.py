"""`paratrain train`: configuration from YAML and flags, validated, then a world of ranks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from paratrain.launch import in_torchrun, run
from paratrain.models import count_parameters, format_count, gpt_parameter_count, model_config
from paratrain.train.config import ConfigError, TrainConfig, apply_overrides, load_yaml, to_dict
from paratrain.train.loop import train_rank
from paratrain.train.validate import validate


class ManyValues(click.Option):
    """An option that takes every value up to the next flag: `--channels 32 64 128`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("type", click.UNPROCESSED)  # keep the list the parser collects
        super().__init__(*args, **kwargs)

    def add_to_parser(self, parser, ctx):
        super().add_to_parser(parser, ctx)
        for name in self.opts:
            option = parser._long_opt.get(name) or parser._short_opt.get(name)
            if option is None:
                continue
            original = option.process

            def process(value, state, original=original):
                values = [value]
                while state.rargs and not state.rargs[0].startswith("-"):
                    values.append(state.rargs.pop(0))
                original(values, state)

            option.process = process


# flag -> dotted config key; every flag defaults to None so only what was typed overrides YAML
FLAG_KEYS = {
    "model": "model.name", "data": "data.name", "global_batch": "data.global_batch",
    "steps": "steps", "seed": "seed", "log_every": "log_every", "metrics_out": "metrics_out",
    "optimizer": "optim.name", "lr": "optim.lr", "momentum": "optim.momentum",
    "weight_decay": "optim.weight_decay", "warmup_steps": "optim.warmup_steps",
    "schedule": "optim.schedule", "nproc": "parallel.nproc", "launcher": "parallel.launcher",
    "dp_mode": "parallel.dp_mode", "algo": "parallel.algo", "naive_layout": "parallel.naive_layout",
    "bucket_mb": "parallel.bucket_mb", "first_bucket_mb": "parallel.first_bucket_mb",
    "grad_accum": "parallel.grad_accum", "compress": "parallel.compress",
    "local_sgd": "parallel.local_sgd", "zero": "parallel.zero", "timeout": "parallel.timeout",
    "debug": "parallel.debug", "hidden": "model.hidden", "width": "model.width",
    "depth": "model.depth", "n_layer": "model.n_layer",
}


def build_config(config_path, flags: dict) -> TrainConfig:
    config = load_yaml(config_path) if config_path else TrainConfig()
    overrides = {FLAG_KEYS[name]: value for name, value in flags.items() if name in FLAG_KEYS}
    if flags.get("channels"):
        try:
            overrides["model.channels"] = tuple(int(c) for c in flags["channels"])
        except ValueError:
            raise ConfigError([f"--channels takes integers, got {' '.join(flags['channels'])}"]) from None
    return apply_overrides(config, overrides)


def world_size_of(config: TrainConfig) -> int:
    return int(os.environ["WORLD_SIZE"]) if in_torchrun() else config.parallel.nproc


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
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML file; flags override it.")
@click.option("--model", help="mlp, mlp16, cnn, gpt-tiny, gpt-small or gpt-seed.")
@click.option("--data", help="Data set (default: the one the model is made for).")
@click.option("--nproc", type=int, help="Ranks to start (default 2; torchrun decides under torchrun).")
@click.option("--launcher", help="threads (in-process fabric) or processes (torch elastic launcher).")
@click.option("--dp-mode", help="naive, ddp (ours) or torch (PyTorch's DDP).")
@click.option("--steps", type=int, help="Optimizer steps (default 50).")
@click.option("--global-batch", type=int, help="Samples per optimizer step across all ranks (default 64).")
@click.option("--seed", type=int, help="Seed for weights and data: same seed, same losses.")
@click.option("--metrics-out", type=click.Path(dir_okay=False), help="Write the per-step log and summary as JSON.")
@click.option("--optimizer", help="sgd (momentum) or adamw.")
@click.option("--lr", type=float, help="Peak learning rate.")
@click.option("--momentum", type=float, help="SGD momentum.")
@click.option("--weight-decay", type=float, help="Weight decay.")
@click.option("--warmup-steps", type=int, help="Linear warm-up steps.")
@click.option("--schedule", help="cosine or constant after warm-up.")
@click.option("--grad-accum", type=int, help="Micro-batches per step; only the last communicates.")
@click.option("--bucket-mb", type=float, help="DDP bucket size in MiB (default 25).")
@click.option("--first-bucket-mb", type=float, help="Our DDP's first, smaller bucket (default 1).")
@click.option("--algo", help="All-reduce algorithm for our modes: ring, hd, tree, direct, native, auto.")
@click.option("--naive-layout", help="naive mode: flat (one buffer) or per-param.")
@click.option("--compress", help="none, fp16, bf16 or topk:RATIO (with error feedback).")
@click.option("--local-sgd", type=int, help="Average parameters every K steps instead of gradients every step.")
@click.option("--zero", type=int, help="1: ZeRO-1, optimizer state sharded across ranks.")
@click.option("--channels", cls=ManyValues, help="CNN channels, e.g. --channels 32 64 128.")
@click.option("--hidden", type=int, help="Hidden width (mlp, cnn).")
@click.option("--width", type=int, help="Width of mlp16.")
@click.option("--depth", type=int, help="Layers of mlp16.")
@click.option("--n-layer", type=int, help="Layers of a GPT.")
@click.option("--timeout", type=float, help="Seconds before a blocking communication fails.")
@click.option("--debug", is_flag=True, default=None, help="Check every collective is the same call on all ranks.")
@click.option("--log-every", type=int, help="Steps between printed log lines.")
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

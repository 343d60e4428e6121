"""The options `paratrain train` and `paratrain check` share, and the config they build."""

from __future__ import annotations

import os

import click

from paratrain.launch import in_torchrun
from paratrain.train.config import ConfigError, TrainConfig, apply_overrides, load_yaml
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
    "eval_every": "eval_every",
    "optimizer": "optim.name", "lr": "optim.lr", "momentum": "optim.momentum",
    "weight_decay": "optim.weight_decay", "warmup_steps": "optim.warmup_steps",
    "lr_schedule": "optim.schedule", "nproc": "parallel.nproc", "launcher": "parallel.launcher",
    "dp_mode": "parallel.dp_mode", "algo": "parallel.algo", "naive_layout": "parallel.naive_layout",
    "bucket_mb": "parallel.bucket_mb", "first_bucket_mb": "parallel.first_bucket_mb",
    "grad_accum": "parallel.grad_accum", "compress": "parallel.compress",
    "local_sgd": "parallel.local_sgd", "zero": "parallel.zero", "timeout": "parallel.timeout",
    "debug": "parallel.debug", "hidden": "model.hidden", "width": "model.width",
    "depth": "model.depth", "n_layer": "model.n_layer", "dp": "parallel.dp", "pp": "parallel.pp",
    "tp": "parallel.tp", "schedule": "parallel.schedule", "microbatches": "parallel.microbatches",
    "virtual_stages": "parallel.virtual_stages", "precision": "parallel.precision",
    "checkpoint_activations": "parallel.checkpoint_activations",
    "sequence_parallel": "parallel.sequence_parallel",
    "save_dir": "checkpoint.dir", "save_every": "checkpoint.every", "keep": "checkpoint.keep",
    "resume": "checkpoint.resume", "max_restarts": "checkpoint.max_restarts",
}


def build_config(config_path, flags: dict) -> TrainConfig:
    config = load_yaml(config_path) if config_path else TrainConfig()
    overrides = {FLAG_KEYS[name]: value for name, value in flags.items() if name in FLAG_KEYS}
    if flags.get("stage_layers"):
        try:
            overrides["parallel.stage_layers"] = [int(c) for c in flags["stage_layers"].split(",")]
        except ValueError:
            raise ConfigError([f"--stage-layers takes comma-separated integers, got {flags['stage_layers']}"]) from None
    if flags.get("channels"):
        try:
            overrides["model.channels"] = tuple(int(c) for c in flags["channels"])
        except ValueError:
            raise ConfigError([f"--channels takes integers, got {' '.join(flags['channels'])}"]) from None
    return apply_overrides(config, overrides)


def world_size_of(config: TrainConfig) -> int:
    """Under torchrun, its world; else --nproc, which defaults to dp x pp x tp."""
    par = config.parallel
    if in_torchrun():
        par.nproc = int(os.environ["WORLD_SIZE"])
        return par.nproc
    if par.nproc is None:
        par.nproc = (par.dp or (1 if par.pp * par.tp > 1 else 2)) * par.pp * par.tp
    return par.nproc


_OPTIONS = [
    click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML file; flags override it."),
    click.option("--model", help="mlp, mlp16, cnn, gpt-tiny, gpt-small or gpt-seed."),
    click.option("--data", help="Data set (default: the one the model is made for); GPTs also take text "
                                "(the shipped Shakespeare) or text:PATH (any file, one token per byte)."),
    click.option("--nproc", type=int, help="Ranks to start (default 2; torchrun decides under torchrun)."),
    click.option("--launcher", help="threads (in-process fabric) or processes (torch elastic launcher)."),
    click.option("--dp-mode", help="naive, ddp (ours) or torch (PyTorch's DDP)."),
    click.option("--steps", type=int, help="Optimizer steps (default 50)."),
    click.option("--global-batch", type=int, help="Samples per optimizer step across all ranks (default 64)."),
    click.option("--seed", type=int, help="Seed for weights and data: same seed, same losses."),
    click.option("--metrics-out", type=click.Path(dir_okay=False), help="Write the per-step log and summary as JSON."),
    click.option("--optimizer", help="sgd (momentum) or adamw."),
    click.option("--lr", type=float, help="Peak learning rate."),
    click.option("--momentum", type=float, help="SGD momentum."),
    click.option("--weight-decay", type=float, help="Weight decay."),
    click.option("--warmup-steps", type=int, help="Linear warm-up steps."),
    click.option("--lr-schedule", help="Learning rate after warm-up: cosine (default) or constant."),
    click.option("--grad-accum", type=int, help="Micro-batches per step; only the last communicates."),
    click.option("--bucket-mb", type=float, help="DDP bucket size in MiB (default 25)."),
    click.option("--first-bucket-mb", type=float, help="Our DDP's first, smaller bucket (default 1)."),
    click.option("--algo", help="All-reduce algorithm for our modes: ring, hd, tree, direct, native, auto."),
    click.option("--naive-layout", help="naive mode: flat (one buffer) or per-param."),
    click.option("--compress", help="none, fp16, bf16 or topk:RATIO (with error feedback)."),
    click.option("--local-sgd", type=int, help="Average parameters every K steps instead of gradients every step."),
    click.option("--zero", type=int, help="1: ZeRO-1, optimizer state sharded across ranks."),
    click.option("--dp", type=int, help="Data-parallel size (default: world / (pp x tp))."),
    click.option("--pp", type=int, help="Pipeline stages (default 1)."),
    click.option("--tp", type=int, help="Tensor-parallel size (default 1; GPT models)."),
    click.option("--schedule", help="Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v."),
    click.option("--microbatches", type=int, help="Microbatches per step through the pipeline."),
    click.option("--virtual-stages", type=int, help="Model chunks per pipeline rank (interleaved-1f1b)."),
    click.option("--stage-layers", help="Explicit layers per chunk, e.g. 3,2,2,3 (default: balanced by cost)."),
    click.option("--checkpoint-activations", is_flag=True, default=None, help="Recompute activations in backward."),
    click.option("--precision", help="fp32 (default) or bf16 (autocast)."),
    click.option("--sequence-parallel", is_flag=True, default=None, help="Shard norm/dropout regions over tp ranks."),
    click.option("--channels", cls=ManyValues, help="CNN channels, e.g. --channels 32 64 128."),
    click.option("--hidden", type=int, help="Hidden width (mlp, cnn)."),
    click.option("--width", type=int, help="Width of mlp16."),
    click.option("--depth", type=int, help="Layers of mlp16."),
    click.option("--n-layer", type=int, help="Layers of a GPT."),
    click.option("--timeout", type=float, help="Seconds before a blocking communication fails."),
    click.option("--debug", is_flag=True, default=None,
                 help="Check every collective is the same call on all ranks; an error prints its traceback."),
    click.option("--log-every", type=int, help="Steps between printed log lines."),
    click.option("--eval-every", type=int,
                 help="Steps between validation losses, and one at the end (default 0: none)."),
]


CHECKPOINT_OPTIONS = [
    click.option("--save-dir", type=click.Path(file_okay=False), help="Save checkpoints in DIR/step-NNNNNN/ (DCP)."),
    click.option("--save-every", type=int, help="Steps between checkpoints (default: only at the end)."),
    click.option("--keep", type=int, help="Complete checkpoints to keep (default 3)."),
    click.option("--resume", is_flag=False, flag_value="latest", default=None, metavar="[PATH]",
                 help="Continue from the latest checkpoint in --save-dir, or from PATH; any dp/tp/pp layout."),
    click.option("--max-restarts", type=int,
                 help="processes launcher: restart all ranks up to N times after a failure, resuming "
                      "from the latest checkpoint in --save-dir."),
]


def checkpoint_options(command):
    for option in reversed(CHECKPOINT_OPTIONS):
        command = option(command)
    return command


def training_options(command):
    """Decorate a click command with every training option (YAML keys, as flags)."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def validated_config(config_path, flags: dict) -> tuple[TrainConfig, int]:
    """The configuration and world size, or a ConfigError naming every problem."""
    config = build_config(config_path, flags)
    world = world_size_of(config)
    validate(config, world)
    return config, world

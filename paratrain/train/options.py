"""The options `paratrain train` and `paratrain check` share, and the config they build."""

from __future__ import annotations

import dataclasses
from typing import Callable

import click

from paratrain.environment import LaunchEnvironment, Settings
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


class Flag:
    """One flag of `paratrain train` / `check`: the dotted config key it sets (None: not a config
    value), click's declaration of it, and `convert` for a value the key holds in another form.
    Adding a flag is adding one of these to TRAINING_FLAGS (or CHECKPOINT_FLAGS)."""

    def __init__(self, key: str | None, *decls: str, convert: Callable | None = None, **attrs):
        self.key, self.decls, self.convert, self.attrs = key, decls, convert, attrs
        named = [d for d in decls if not d.startswith("-")]
        self.dest = named[0] if named else decls[0].lstrip("-").replace("-", "_")

    def option(self):
        return click.option(*self.decls, **self.attrs)


def _stage_layers(text: str) -> list[int]:
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        raise ConfigError([f"--stage-layers takes comma-separated integers, got {text}"]) from None


def _channels(values: list[str]) -> list[int]:
    try:  # a list, as YAML gives it: --print-config's output read back is the same configuration
        return [int(c) for c in values]
    except ValueError:
        raise ConfigError([f"--channels takes integers, got {' '.join(values)}"]) from None


# Every flag defaults to None, so only what was typed overrides the YAML file.
TRAINING_FLAGS = [
    Flag(None, "--config", "config_path", type=click.Path(dir_okay=False), help="YAML file; flags override it."),
    Flag("model.name", "--model", help="mlp, mlp16, cnn, gpt-tiny, gpt-small, gpt-seed, llama-tiny, llama-small, "
                                       "tinyllama-1.1b, moe-tiny, moe-small, mixtral-8x7b, olmoe-1b-7b, "
                                       "or your own: FILE.py:FUNCTION (returns ids -> logits), or a Hugging Face "
                                       "transformers model built from its config: hf:llama, hf:mistral, hf:qwen2, "
                                       "hf:qwen3, hf:gpt2 (needs the hf extra)."),
    Flag("model.plan", "--plan", type=click.Path(dir_okay=False), help="Parallelism plan (YAML) for --model FILE.py:FUNCTION."),
    Flag("model.hf_config", "--hf-config", type=click.Path(dir_okay=False),
         help="hf:FAMILY: a JSON file of transformers config fields (a config.json will do; default: a tiny "
              "config of the family). Weights are random, from --seed; nothing is downloaded."),
    Flag("data.name", "--data", help="Data set (default: the one the model is made for); your own as FILE.py:FUNCTION "
                                     "(returns a map-style data set of (inputs, targets) pairs); language models also "
                                     "take text (the shipped Shakespeare), text:PATH (any file, one token per byte) or "
                                     "tokens:PATH (a flat file of uint16 token ids, nanoGPT's train.bin; "
                                     "tokens:PATH:uint32 for larger vocabularies)."),
    Flag("data.loss", "--loss", help="Your loss, FILE.py:FUNCTION: (outputs, targets) -> the batch's mean loss "
                                     "(default: the data set's; your data's is cross-entropy for integer targets, "
                                     "mean squared error for float ones)."),
    Flag("parallel.nproc", "--nproc", type=int, help="Ranks to start (default 2; torchrun decides under torchrun)."),
    Flag("parallel.launcher", "--launcher", help="threads (in-process fabric) or processes (torch elastic launcher)."),
    Flag("parallel.simulate_hosts", "--simulate-hosts", type=int,
         help="processes launcher: play N hosts on this machine, nproc/N consecutive ranks on each (PARATRAIN_HOST): "
              "shared memory inside a host, gloo between hosts, as on a cluster."),
    Flag("parallel.dp_mode", "--dp-mode", help="Data-parallel strategy (default ddp, or what --zero / --local-sgd "
                                                "say): naive, ddp, torch-ddp (or torch), zero1, torch-zero1, zero2, fsdp "
                                                "(or zero3), torch-fsdp, local-sgd. `torch-` ones are PyTorch's."),
    Flag("steps", "--steps", type=int, help="Optimizer steps (default 50)."),
    Flag("data.global_batch", "--global-batch", type=int, help="Samples per optimizer step across all ranks (default 64)."),
    Flag("seed", "--seed", type=int, help="Seed for weights and data: same seed, same losses."),
    Flag("metrics_out", "--metrics-out", type=click.Path(dir_okay=False), help="Write the per-step log and summary as JSON."),
    Flag("log", "--log", help="Also log every step to tensorboard:DIR and/or wandb[:DIR] (offline), comma-"
                              "separated; rank 0 writes (needs the hf extra, or wandb)."),
    Flag("optim.name", "--optimizer", help="sgd (momentum) or adamw."),
    Flag("optim.lr", "--lr", type=float, help="Peak learning rate."),
    Flag("optim.momentum", "--momentum", type=float, help="SGD momentum."),
    Flag("optim.weight_decay", "--weight-decay", type=float, help="Weight decay."),
    Flag("optim.warmup_steps", "--warmup-steps", type=int, help="Linear warm-up steps."),
    Flag("optim.clip_grad_norm", "--clip-grad-norm", type=float,
         help="Clip gradients to this global 2-norm, over every dp/tp/pp/zero shard (0: off, the default)."),
    Flag("optim.schedule", "--lr-schedule", help="Learning rate after warm-up: cosine (default) or constant."),
    Flag("parallel.grad_accum", "--grad-accum", type=int, help="Micro-batches per step; only the last communicates."),
    Flag("parallel.bucket_mb", "--bucket-mb", type=float, help="DDP bucket size in MiB (default 25)."),
    Flag("parallel.first_bucket_mb", "--first-bucket-mb", type=float, help="Our DDP's first, smaller bucket (default 1)."),
    Flag("parallel.algo", "--algo", help="All-reduce algorithm for our modes: ring, hd, tree, direct, native, auto."),
    Flag("parallel.naive_layout", "--naive-layout", help="naive mode: flat (one buffer) or per-param."),
    Flag("parallel.compress", "--compress", help="none, fp16, bf16 or topk:RATIO (with error feedback)."),
    Flag("parallel.local_sgd", "--local-sgd", type=int, help="Average parameters every K steps instead of gradients "
                                                              "every step (--dp-mode local-sgd)."),
    Flag("parallel.zero", "--zero", type=int, help="ZeRO stage, sharded across ranks: 1 optimizer state, 2 and "
                                                    "gradients, 3 and parameters (FSDP): the same as --dp-mode zero1, "
                                                    "zero2 or fsdp (with --dp-mode torch: PyTorch's)."),
    Flag("parallel.reshard_after_forward", "--reshard-after-forward/--no-reshard-after-forward",
         "reshard_after_forward", default=None,
         help="zero 3: free each unit's gathered parameters after its forward (default) or keep them for backward."),
    Flag("parallel.prefetch", "--prefetch", type=int,
         help="zero 3: units whose all-gather starts ahead of their use, forward and backward (default 1; 0: off)."),
    Flag("parallel.dp", "--dp", type=int, help="Data-parallel size (default: world / (pp x cp x tp))."),
    Flag("parallel.pp", "--pp", type=int, help="Pipeline stages (default 1)."),
    Flag("parallel.tp", "--tp", type=int, help="Tensor-parallel size (default 1; GPT models)."),
    Flag("parallel.cp", "--cp", type=int, help="Context-parallel size: each rank holds 1/cp of every sequence, "
                                                "attention by ring (default 1; language models with a plan)."),
    Flag("parallel.ep", "--ep", type=int, help="Expert-parallel size: each of ep data ranks holds 1/ep of every "
                                                "mixture-of-experts layer's experts; tokens travel to them by "
                                                "all-to-all (default 1; must divide dp x cp)."),
    Flag("parallel.cp_method", "--cp-method", help="ring (K/V passed round the cp ranks, default), allgather (gathered once per layer), or auto "
                                                       "(the planner's cost model picks; --plan-only shows why)."),
    Flag("parallel.cp_layout", "--cp-layout", help="zigzag (every rank the same causal work, default) or contiguous."),
    Flag("parallel.schedule", "--schedule", help="Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v."),
    Flag("parallel.microbatches", "--microbatches", type=int, help="Microbatches per step through the pipeline."),
    Flag("parallel.virtual_stages", "--virtual-stages", type=int, help="Model chunks per pipeline rank (interleaved-1f1b)."),
    Flag("parallel.stage_layers", "--stage-layers", convert=_stage_layers, help="Explicit layers per chunk, e.g. 3,2,2,3 (default: balanced by cost)."),
    Flag("parallel.compile", "--compile", is_flag=True, default=None,
         help="Each layer through torch.compile; the first two steps run eager, so the summary gives both."),
    Flag("parallel.checkpoint_activations", "--checkpoint-activations", is_flag=True, default=None, help="Recompute activations in backward."),
    Flag("parallel.precision", "--precision", help="fp32 (default), bf16 or fp16 (autocast; fp16 with dynamic loss "
                                                    "scaling, overflowed steps skipped and counted)."),
    Flag("parallel.loss_scale", "--loss-scale", type=float,
         help="fp16: the initial loss scale (default 65536, torch.amp.GradScaler's; halved on each overflow, "
              "doubled after 2000 steps without one)."),
    Flag("parallel.sequence_parallel", "--sequence-parallel", is_flag=True, default=None, help="Shard norm/dropout regions over tp ranks."),
    Flag("model.channels", "--channels", cls=ManyValues, convert=_channels, help="CNN channels, e.g. --channels 32 64 128."),
    Flag("model.hidden", "--hidden", type=int, help="Hidden width (mlp, cnn)."),
    Flag("model.width", "--width", type=int, help="Width of mlp16."),
    Flag("model.depth", "--depth", type=int, help="Layers of mlp16."),
    Flag("model.n_layer", "--n-layer", type=int, help="Layers of a GPT or Llama."),
    Flag("model.vocab_size", "--vocab-size", type=int, help="Vocabulary of a language model (default: the model's)."),
    Flag("model.block_size", "--block-size", type=int, help="Context length of a language model (default: the model's)."),
    Flag("model.tie_embeddings", "--tie-embeddings", is_flag=True, default=None,
         help="Llama: the output layer shares the token embedding's table (as Llama-3.2-1B and GPT-2 do)."),
    Flag("parallel.timeout", "--timeout", type=float, help="Seconds before a blocking communication fails."),
    Flag("parallel.debug", "--debug", is_flag=True, default=None, help="Check every collective is the same call on all ranks; an error prints its traceback."),
    Flag("log_every", "--log-every", type=int, help="Steps between printed log lines."),
    Flag("profile", "--profile", type=click.Path(file_okay=False),
         help="Write a torch.profiler trace (DIR/trace.json, every rank; ui.perfetto.dev) of --profile-steps "
              "steps after the first, with our collectives as named ranges."),
    Flag("profile_steps", "--profile-steps", type=int, help="Steps --profile records (default 2)."),
    Flag("peak_tflops", "--peak-tflops", type=float,
         help="Peak TFLOP/s of one device in the precision trained in: the summary's MFU is measured against it "
              "(`paratrain plan --hardware NAME` shows a profile's; without it, the TFLOP/s achieved per rank)."),
    Flag("eval_every", "--eval-every", type=int,
        help="Steps between validation losses, and one at the end (default 0: none)."),
    Flag("checkpoint.init_from", "--init-from", type=click.Path(file_okay=False),
         help="Start from a Hugging Face model directory's weights (safetensors, as `paratrain export --to hf` "
              "writes them), any layout; the optimizer starts fresh. Not with --resume."),
]


CHECKPOINT_FLAGS = [
    Flag("checkpoint.dir", "--save-dir", type=click.Path(file_okay=False), help="Save checkpoints in DIR/step-NNNNNN/ (DCP)."),
    Flag("checkpoint.every", "--save-every", type=int, help="Steps between checkpoints (default: only at the end)."),
    Flag("checkpoint.keep", "--keep", type=int, help="Complete checkpoints to keep (default 3)."),
    Flag("checkpoint.resume", "--resume", is_flag=False, flag_value="latest", default=None, metavar="[PATH]",
        help="Continue from the latest checkpoint in --save-dir, or from PATH; any dp/tp/pp layout."),
    Flag("checkpoint.max_restarts", "--max-restarts", type=int,
        help="processes launcher: restart all ranks up to N times after a failure, resuming "
             "from the latest checkpoint in --save-dir."),
]


def build_config(config_path, flags: dict) -> TrainConfig:
    config = load_yaml(config_path) if config_path else TrainConfig()
    overrides = {}
    for flag in TRAINING_FLAGS + CHECKPOINT_FLAGS:
        value = flags.get(flag.dest)
        if flag.key is None or value is None or (flag.convert is not None and not value):
            continue
        overrides[flag.key] = flag.convert(value) if flag.convert else value
    return apply_overrides(config, overrides)


def world_size_of(config: TrainConfig, launch: LaunchEnvironment) -> int:
    """Under torchrun, its world; else --nproc, which defaults to dp x pp x cp x tp. Reads the
    config, never changes it."""
    par = config.parallel
    if launch.in_torchrun:
        return launch.world_size
    if par.nproc is not None:
        return par.nproc
    return (par.dp or (1 if par.replica_ranks > 1 else 2)) * par.replica_ranks


def checkpoint_options(command):
    for flag in reversed(CHECKPOINT_FLAGS):
        command = flag.option()(command)
    return command


def training_options(command):
    """Decorate a click command with every training option (YAML keys, as flags)."""
    for flag in reversed(TRAINING_FLAGS):
        command = flag.option()(command)
    return command


def validated_config(config_path, flags: dict, settings: Settings) -> tuple[TrainConfig, int]:
    """The configuration (its nproc the world size) and world size, or a ConfigError naming
    every problem."""
    config = build_config(config_path, flags)
    world = world_size_of(config, settings.launch)
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, nproc=world))
    validate(config, world)
    return config, world

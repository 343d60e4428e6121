"""`paratrain train`: configuration from YAML and flags, validated, then a world of ranks."""

from __future__ import annotations

import json
from pathlib import Path

import click

from paratrain.launch import describe_transport, hosts_of, run
from paratrain.models import CAUSAL_LM_CONFIGS, GPTConfig, LlamaConfig, count_parameters, format_count, \
    model_config, parameter_count
from paratrain.parallel.pipeline.split import balanced_partition, layer_costs, pipeline_layers
from paratrain.parallel.data.strategy import strategy_of
from paratrain.parallel.plan import matching_modules
from paratrain.parallel.pipeline.schedules import build_schedule
from paratrain.parallel.pipeline.simulate import theoretical_bubble
from paratrain.parallel.pipeline.timeline import format_timeline
from paratrain.environment import Settings
from paratrain.train.config import TrainConfig, to_dict
from paratrain.train.config_reference import config_yaml
from paratrain.train.context_method import context_plan
from paratrain.train.moe_plan import moe_plan_lines
from paratrain.train.loop import train_rank
from paratrain.train.memory import estimate, format_estimate
from paratrain.train.options import checkpoint_options, training_options, validated_config
from paratrain.train.setup import fsdp_units_note, meta_model, plan_for


def describe_model(config: TrainConfig) -> str:
    params = parameter_count(model_config(config.model.name, **config.model.overrides))
    if params is None:
        from paratrain.train.setup import build_seeded_model

        params = count_parameters(build_seeded_model(config.model.name, config.model.overrides, config.seed))
    return f"{config.model.name}: {params:,} parameters ({format_count(params)})"


def print_summary(summary: dict) -> None:
    rows = [
        ("final loss", f"{summary['final_loss']:.5f} (from {summary['first_loss']:.5f}"
         + (f" at step {summary['first_step']}, where this run resumed)" if summary.get("first_step") else ")")),
        ("step time", f"{summary['step_ms']:.1f} ms (stdev {summary['step_ms_stdev']:.1f})"),
        ("compute", f"{summary['compute_ms']:.1f} ms"),
        ("communication", f"{summary['comm_ms']:.1f} ms in all, {summary['exposed_comm_ms']:.1f} ms not hidden"),
        ("throughput", f"{summary['samples_per_s']:,.0f} samples/s"
         + (f", {summary['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in summary else "")),
    ]
    if "val_loss" in summary:
        accuracy = f", accuracy {summary['val_accuracy']:.1%}" if "val_accuracy" in summary else ""
        rows.insert(1, ("validation", f"loss {summary['val_loss']:.5f}{accuracy} (last evaluation)"))
    if "tflops_per_rank" in summary:
        rows.append(("model FLOPs", f"{summary['model_flops_per_step']:.3g} per step, "
                                    f"{summary['tflops_per_rank']:.3g} TFLOP/s per rank"
                     + (f", MFU {summary['mfu']:.1%} of {summary['peak_tflops']:g} TFLOP/s" if "mfu" in summary
                        else " (MFU: give --peak-tflops)")))
    if "compiled_step_ms" in summary:
        rows.append(("compiled", f"{summary['compiled_step_ms']:.1f} ms a step, eager {summary['eager_step_ms']:.1f} ms "
                                 f"({summary['compile_speedup']:.2f}x); the first compiled step took "
                                 f"{summary['first_compiled_step_ms'] / 1e3:.1f} s (compiling)"))
    if "clipped_steps" in summary:
        rows.append(("clipping", f"{summary['clipped_steps']} of {summary['steps']} steps clipped "
                                 f"(largest gradient norm {summary['max_grad_norm']:.4g})"))
    if "expert_imbalance" in summary:
        rows.append(("experts", f"tokens per expert max / mean {summary['expert_imbalance']:.2f} (worst layer), "
                                f"per ep rank {summary['ep_rank_imbalance']:.2f}; {summary['dropped_pairs']} "
                                "(token, expert) pairs dropped over capacity"))
    if "memory" in summary:
        rows.append(("memory", _memory_line(summary["memory"])))
    if "bubble" in summary:
        rows.append(("bubble", f"{summary['bubble']:.1%} measured on rank 0 (time not computing), "
                               f"{summary['theoretical_bubble']:.1%} in the schedule"))
    click.echo("summary (means over steps after the first):")
    for name, value in rows:
        click.echo(f"  {name:14s} {value}")


def _memory_line(memory: dict[str, list[int]]) -> str:
    """Held per rank (largest over ranks): parameters, gradients and optimizer state at rest, and
    their peak during a step."""
    mib = lambda key: f"{max(memory[key]) / 2**20:.2f}"  # noqa: E731
    return (f"per rank, MiB: params {mib('params_bytes')}, grads {mib('grads_bytes')}, optimizer "
            f"{mib('optimizer_bytes')} at rest; peak in a step {mib('peak_bytes')}, activations saved for "
            f"backward {mib('activations_bytes')} at their peak (largest over ranks)")


def placement_line(per_host: int, tp: int, cp: int) -> str:
    """Whether the mesh keeps the axes that talk every layer (tp, then cp: adjacent ranks) inside a
    host, `per_host` consecutive ranks each, as it means to, and data parallelism across hosts."""
    inner, names = tp * cp, "tp x cp" if cp > 1 else "tp"
    if inner == 1:
        return f"{per_host} ranks per host: only the data-parallel (and pipeline) groups cross hosts"
    if per_host % inner == 0:
        return f"{per_host} ranks per host: {names} ({inner} ranks) inside each host, the other axes across"
    return (f"{per_host} ranks per host: {names} spans {inner} ranks, which do not fit a host's {per_host}: its "
            "collectives cross hosts every layer (make it divide the ranks per host)")


def describe_run(config: TrainConfig, world: int, settings: Settings) -> list[str]:
    """What is about to run: the world, its mesh and transport, the schedule, and (GPT) memory
    per rank."""
    par = config.parallel
    dp = world // par.replica_ranks
    launcher = "torchrun" if settings.launch.in_torchrun else par.launcher
    strategy = strategy_of(par)
    cp = f" x cp {par.cp} ({context_plan(config, world).method}, {par.cp_layout})" if par.cp > 1 else ""
    ep = f", experts split over ep {par.ep}" if par.ep > 1 else ""
    lines = [f"world {world} = dp {dp} x pp {par.pp}{cp} x tp {par.tp}{ep} ({launcher}), data parallelism {strategy.name} "
             f"(shards {strategy.shards}), transport {describe_transport(par.launcher, world, settings, par.simulate_hosts)}"]
    hosts = hosts_of(world, settings, par.simulate_hosts)
    if hosts > 1:
        lines.append(placement_line(world // hosts, par.tp, par.cp))
    if par.pp > 1:
        per_micro = config.data.global_batch // (dp * par.microbatches)
        lines.append(f"global batch {config.data.global_batch}: {config.data.global_batch // dp} per replica, "
                     f"{par.microbatches} microbatches of {per_micro} through the pipeline")
        schedule = build_schedule(par.schedule, par.pp, par.microbatches, par.virtual_stages)
        if par.microbatches <= 16:
            lines.append(format_timeline(schedule))
        else:
            lines.append(f"{schedule.name}: theoretical bubble {theoretical_bubble(schedule.name, schedule.stages, schedule.microbatches, schedule.virtual_stages):.1%}")
    else:
        lines.append(f"global batch {config.data.global_batch} ({config.data.global_batch // dp} per replica"
                     + (f", {par.grad_accum} micro-batches" if par.grad_accum > 1 else "") + ")")
    shape = model_config(config.model.name, **config.model.overrides)
    if isinstance(shape, CAUSAL_LM_CONFIGS) and par.pp * par.tp > 1:  # (cp splits no layer)
        lines += describe_split(config)
    if par.cp > 1:
        lines += context_plan(config, world).lines
    lines += moe_plan_lines(config, world)
    if strategy.zero == 3:
        lines += fsdp_units_note(config)
    if isinstance(shape, (GPTConfig, LlamaConfig)) and (par.pp * par.tp > 1 or strategy.zero) and not config.model.plan:
        lines.append(format_estimate(estimate(config, world), par.tp))
    if config.checkpoint.resume is not None:
        from paratrain.train.checkpoint import resolve, skipped_checkpoints

        chosen = resolve(config.checkpoint.resume, config.checkpoint.dir)  # validation has read it
        lines += [*skipped_checkpoints(chosen), f"resuming from {chosen}"]
    return lines


def describe_split(config: TrainConfig) -> list[str]:
    """How the plan splits the model: each tensor-parallel pattern with its style and the modules
    it matched, and the pipeline chunks' layers (built on the meta device: nothing allocated)."""
    par = config.parallel
    model = meta_model(config.model.name, config.model.overrides)
    plan = plan_for(config.model.plan, model)
    lines = [f"plan: {plan.source}" if config.model.plan else "plan: the model's own"]
    if par.tp > 1:
        sp = par.sequence_parallel or plan.sequence_parallel
        lines.append(f"  tensor parallel over {par.tp} ranks" + (", sequence parallel" if sp else "") + ":")
        for pattern, style in plan.tensor_parallel.items():
            found = [name for name, _ in matching_modules(model, pattern)]
            parts = f" ({style.parts} fused parts)" if style.parts > 1 else ""
            lines.append(f"    {pattern:28s} {style.name}{parts}: {len(found)} module(s)")
    if par.pp > 1 and plan.pipeline.balance == "measured" and not par.stage_layers:
        lines.append("  pipeline chunks: balanced by the layers' times, measured when the run starts")
    elif par.pp > 1:
        layers = pipeline_layers(model, plan)
        chunks = par.pp * (2 if par.schedule == "zb-v" else par.virtual_stages)
        counts = par.stage_layers or balanced_partition(layer_costs(layers, plan.pipeline.balance), chunks)
        names = ["before: " + ", ".join(_part_name(model, p) for p in layers[0].parts)]
        names += [f"{plan.pipeline.blocks}.{i}" for i in range(len(layers) - 2)]
        names += ["after: " + ", ".join(_part_name(model, p) for p in layers[-1].parts)]
        schedule = build_schedule(par.schedule, par.pp, par.microbatches, par.virtual_stages)
        start = 0
        for chunk, count in enumerate(counts):
            held = names[start:start + count]
            shown = held if len(held) <= 3 else [held[0], "...", held[-1]]
            owner = next(r for r in range(par.pp) if chunk in schedule.chunks_of(r))
            lines.append(f"  pipeline chunk {chunk} (stage {owner}): {len(held)} layer(s): {'; '.join(shown)}")
            start += count
    return lines


def _part_name(model, part) -> str:
    return next((name for name, module in model.named_modules() if module is part), type(part).__name__)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@training_options
@checkpoint_options
@click.option("--plan-only", is_flag=True,
              help="Print the model, mesh, schedule, the plan's split and memory per rank; do not train.")
@click.option("--print-config", is_flag=True,
              help="Print the resolved configuration as YAML (a file for --config) and exit; do not train.")
@click.option("--benchmark", is_flag=True,
              help="Measure instead of train: `paratrain bench train` with these options.")
@click.option("--max-nproc", type=click.IntRange(min=1),
              help="With --benchmark: every world size up to this (multiples of pp x tp), batch per replica fixed.")
@click.pass_context
def train(ctx, config_path, plan_only, print_config, benchmark, max_nproc, **flags):
    """Train a model on a world of ranks: data, tensor and pipeline parallelism.

    \b
    Examples:
      paratrain train --model mlp --nproc 4 --dp-mode ddp --steps 100
      paratrain train --model cnn --channels 32 64 128 --hidden 512 --launcher processes
      paratrain train --model gpt-small --tp 2 --pp 4 --schedule 1f1b --microbatches 8
      paratrain train --model gpt-seed --tp 2 --pp 4 --schedule 1f1b --microbatches 8 --plan-only
      paratrain train --model llama-small --data text --tp 2 --pp 2 --microbatches 4
      paratrain train --model my_model.py:build --plan my_plan.yaml --tp 2 --pp 2 --dp 2 --microbatches 4
      torchrun --nproc-per-node 4 -m paratrain train --model mlp16
      paratrain train --model gpt-tiny --tp 2 --save-dir ckpt --save-every 10
      paratrain train --model gpt-tiny --nproc 4 --save-dir ckpt --resume --steps 100
      paratrain bench train --model gpt-tiny --max-nproc 4 --steps 10   (or: train --benchmark)
    """
    if max_nproc and not benchmark:
        raise click.UsageError("--max-nproc goes with --benchmark")
    if benchmark and not (plan_only or print_config):
        return _benchmark(ctx, config_path, max_nproc, flags)
    settings = Settings.resolve()
    config, world = validated_config(config_path, flags, settings)
    if print_config:
        click.echo(config_yaml(config), nl=False)
        return
    if not settings.launch.in_torchrun or settings.launch.rank == 0:
        click.echo(describe_model(config))
        for line in describe_run(config, world, settings):
            click.echo(line)
    if plan_only:
        return
    results = run(train_rank, world, launcher=config.parallel.launcher, args=(config,),
                  timeout=config.parallel.timeout, debug=config.parallel.debug or None,
                  max_restarts=config.checkpoint.max_restarts, settings=settings,
                  simulate_hosts=config.parallel.simulate_hosts)
    if 0 not in results:
        return
    result = results[0]
    print_summary(result["summary"])
    if config.metrics_out:
        path = Path(config.metrics_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"config": to_dict(config), **result}, indent=1))
        click.echo(f"metrics written to {path}")


def _benchmark(ctx, config_path, max_nproc, flags) -> None:
    """`train --benchmark` is `bench train`: found through the command tree, not imported, since
    bench/ is the layer above this one."""
    bench = ctx.find_root().command.get_command(ctx, "bench")
    if bench is None:
        raise click.UsageError("--benchmark runs `paratrain bench train`, which this program lacks")
    ctx.invoke(bench.get_command(ctx, "train"), config_path=config_path, max_nproc=max_nproc, **flags)

"""`paratrain plan`: predict a GPT's step time, memory and MFU on a cluster, or search layouts."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import click

from paratrain.cli_types import OutputPath
from paratrain.errors import Problems
from paratrain.models import format_count
from paratrain.plan.cost_model import Prediction, context_choice, predict
from paratrain.plan.flops import RECOMPUTE, step_flops
from paratrain.plan.hardware import load_profile, shipped_profiles
from paratrain.plan.memory import GIB, Layout
from paratrain.plan.moe import describe_dispatch
from paratrain.plan.search import layout_problems, reason, search
from paratrain.plan.shapes import GPTShape, named_shape, shape_names

LAYOUT_FLAGS = ("tp", "pp", "cp", "cp_method", "dp", "micro_batch", "virtual_stages", "schedule", "recompute",
                "sequence_parallel", "zero", "ep")


def build_shape(model: str, overrides: dict) -> GPTShape:
    base = named_shape(model)
    values = {f.name: getattr(base, f.name) for f in fields(base)}  # a mixture of experts keeps its experts
    values.update({k: v for k, v in overrides.items() if v is not None})
    if overrides.get("hidden") is not None and overrides.get("mlp") is None:
        values["mlp"] = 0  # 4h of the new width
    values["kv_heads"] = _kv_heads(model, base, overrides.get("heads"), overrides.get("kv_heads"))
    return GPTShape(**values)


def _kv_heads(model: str, base: GPTShape, heads: int | None, kv_heads: int | None) -> int:
    """The key/value heads of the base with `heads` overridden: a base without grouped-query
    attention stays without it (a published GPT given by its flags must not turn into a
    grouped-query one); a grouped-query base keeps its kv heads only where they still divide."""
    if kv_heads is not None:
        return kv_heads
    if heads is None:
        return base.kv_heads
    if base.kv_heads == base.heads:
        return heads
    if heads % base.kv_heads:
        raise ValueError(f"{model}'s {base.kv_heads} key/value heads do not divide --heads {heads}: "
                         "pass --kv-heads")
    return base.kv_heads


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def _context_note(layout: Layout, exposed_s: float) -> str:
    if layout.cp_method == "allgather":
        return "(the all-gather: nothing hides it)"
    return "(the ring hides behind attention)" if exposed_s == 0 else "(the ring's hops attention does not hide)"


def describe_prediction(p: Prediction, shape: GPTShape, global_batch: int, profile) -> list[str]:
    layout, b = p.layout, p.breakdown
    lines = [f"layout {layout.describe()}: {layout.microbatches(global_batch)} microbatches of "
             f"{layout.micro_batch} per replica per step",
             f"  step time     {_seconds(p.step_s):>10}   ({global_batch / p.step_s:,.3g} samples/s, "
             f"{global_batch * shape.seq / p.step_s:,.0f} tokens/s)"]
    notes = {"bubble": f"({p.bubble:.1%} of the pipeline's time idle)" if layout.pp > 1 else "",
             "dp_comm": "(not hidden by backward)" if layout.replicas > 1 else "",
             "cp_comm": _context_note(layout, b["cp_comm"]) if layout.cp > 1 else "",
             "ep_comm": "(dispatch and combine all-to-alls, forward and backward)"}
    for key, label in (("compute", "compute"), ("tp_comm", "tp comm"), ("pp_comm", "pp comm"), ("cp_comm", "cp comm"),
                       ("ep_comm", "ep comm"), ("bubble", "bubble"), ("dp_comm", "dp comm"),
                       ("optimizer", "optimizer")):
        if (key == "cp_comm" and layout.cp == 1) or (key == "ep_comm" and layout.ep == 1):
            continue
        lines.append(f"    {label:<11} {_seconds(b[key]):>10}  {b[key] / p.step_s:6.1%}  {notes.get(key, '')}".rstrip())
    if layout.cp > 1:
        lines += ["  " + line for line in context_choice(shape, layout, profile).describe(layout.cp_method, profile.name)]
    if layout.ep > 1:
        lines.append("  " + describe_dispatch(shape, layout, b["ep_comm"], profile.name))
    across = [c.describe(axis) for axis, c in p.collectives.items() if c.where.spans]
    if across:
        lines += ["  across nodes, one call each (the step time counts flat, docs/planning.md):"]
        lines += ["    " + line for line in across]
    m = p.memory
    usable = profile.usable_bytes / GIB
    lines += [
        f"  memory/GPU    {m.total / GIB:>8.2f} GiB   of {usable:.1f} usable"
        f" ({'fits' if p.fits else 'DOES NOT FIT'}; pipeline rank {m.stage}, {m.params:,} parameters)",
        f"    weights {m.weights / GIB:.2f}, grads {m.grads / GIB:.2f}, optimizer {m.optimizer / GIB:.2f}, "
        f"activations {m.activations / GIB:.2f}, workspace {m.workspace / GIB:.2f} GiB",
        f"  MFU {p.mfu:.1%} (HFU {p.hfu:.1%}) of {profile.compute.peak_tflops:g} TFLOP/s per device;"
        f" {step_flops(shape, global_batch):.3g} model FLOPs per step",
    ]
    return lines


def search_lines(results: list[Prediction], dropped: dict, top: int) -> list[str]:
    lines = [f"  {'#':>2}  {'layout':<48} {'step':>9} {'mem GiB':>8} {'bubble':>7} {'MFU':>6}  why"]
    for i, p in enumerate(results[:top], 1):
        lines.append(f"  {i:>2}  {p.layout.describe():<48} {_seconds(p.step_s):>9} {p.memory.total / GIB:>8.1f}"
                     f" {p.bubble:>7.1%} {p.mfu:>6.1%}  {reason(p, results[0])}")
    smallest = dropped["smallest_that_does_not_fit_gib"]
    lines.append(f"  {dropped['considered']} valid layouts; {dropped['do_not_fit']} do not fit even with full "
                 "recomputation" + (f" (the smallest of them needs {smallest:.1f} GiB)" if smallest else "")
                 + f"; {len(results)} fit")
    return lines


@click.command()
@click.option("--model", default="gpt-small", show_default=True,
              help=f"A GPT to start from: {', '.join(shape_names())}; the flags below override it.")
@click.option("--layers", type=click.IntRange(min=1), help="Transformer layers l.")
@click.option("--hidden", type=click.IntRange(min=1), help="Hidden size h (the MLP is 4h unless --mlp).")
@click.option("--heads", type=click.IntRange(min=1),
              help="Attention heads a. The key/value heads follow them, unless the model has grouped-query "
                   "attention: then it keeps its key/value heads if they divide a, else give --kv-heads.")
@click.option("--kv-heads", type=click.IntRange(min=1),
              help="Key/value heads g, dividing a: fewer than a is grouped-query attention (Llama models only).")
@click.option("--seq", type=click.IntRange(min=1), help="Sequence length s.")
@click.option("--vocab", type=click.IntRange(min=1), help="Vocabulary V.")
@click.option("--mlp", type=click.IntRange(min=1), help="MLP inner width (default 4h).")
@click.option("--hardware", default="a100-80gb-hdr", show_default=True,
              help=f"A shipped profile ({', '.join(shipped_profiles())}) or a YAML file.")
@click.option("--gpus", type=click.IntRange(min=1), help="Devices (default: tp x pp x dp of the layout given).")
@click.option("--global-batch", type=click.IntRange(min=1), default=64, show_default=True, help="Sequences per step.")
@click.option("--tp", type=click.IntRange(min=1), help="Tensor-parallel size. Any layout flag predicts that layout.")
@click.option("--pp", type=click.IntRange(min=1), help="Pipeline stages.")
@click.option("--dp", type=click.IntRange(min=1), help="Data-parallel size (default: gpus / (tp x pp)).")
@click.option("--micro-batch", type=click.IntRange(min=1), help="Sequences per microbatch (default 1).")
@click.option("--virtual-stages", type=click.IntRange(min=1), help="Model chunks per pipeline rank.")
@click.option("--schedule", help="gpipe, 1f1b (default), interleaved-1f1b, zb-h1 or zb-v.")
@click.option("--recompute", type=click.Choice(RECOMPUTE), help="Activation recomputation (default none).")
@click.option("--sequence-parallel", is_flag=True, default=None, help="Sequence parallelism (tp > 1).")
@click.option("--cp", type=click.IntRange(min=1),
              help="Context-parallel size: each rank holds 1/cp of every sequence (ring attention).")
@click.option("--cp-method", type=click.Choice(("auto", "ring", "allgather")),
              help="How keys and values reach every cp rank: ring (passed round, hidden behind attention), "
                   "allgather (gathered once per layer), or auto (default: the one whose exposed time is smaller).")
@click.option("--ep", type=click.IntRange(min=1),
              help="Expert-parallel size (a mixture of experts): ep of the dp x cp ranks each hold 1/ep "
                   "of the experts.")
@click.option("--zero", type=click.IntRange(0, 3),
              help="ZeRO stage over dp: 1 optimizer state, 2 and gradients, 3 and parameters (FSDP).")
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="Layouts to show when searching.")
@click.option("--json", "json_path", type=OutputPath(path_type=Path),
              help="Write {layout, step_s, memory_gib, bubble, mfu, breakdown} per layout to this file.")
@click.option("--validate", is_flag=True,
              help="Train small configurations on this machine and print predicted against measured "
                   "step time and memory (uses --hardware if given as a file, else the local CPU profile).")
@click.option("--steps", type=click.IntRange(min=2), default=8, show_default=True,
              help="--validate: steps per configuration (the first is not timed).")
@click.option("--renice", type=click.IntRange(0, 20), default=0, show_default=True,
              help="--validate: start the ranks this many nice levels above other programs (root only); "
                   "they then slow those programs while it runs.")
def plan(model, layers, hidden, heads, kv_heads, seq, vocab, mlp, hardware, gpus, global_batch, top, json_path,
         validate, steps, renice, **layout_flags):
    """Predict step time, memory per GPU and MFU of a GPT on a cluster, or find the best layouts.

    With any layout flag (--tp, --pp, --dp, ...) it predicts that layout; without, it searches
    every valid layout, drops those that do not fit and prints the fastest with the reason each
    wins or loses. Formulas: FLOPs as Narayanan et al. 2021, activations as Korthikanti et al.
    2022, bubbles from paratrain's schedule simulator on the actual schedule.

    \b
    Examples:
      paratrain plan --model gpt3-175b --hardware a100-80gb-hdr --gpus 64 --global-batch 64 \\
          --tp 8 --pp 8 --schedule interleaved-1f1b --virtual-stages 3 --recompute full
      paratrain plan --model gpt3-175b --gpus 64 --global-batch 64
      paratrain plan --layers 32 --hidden 4096 --heads 32 --seq 4096 --vocab 32000 --gpus 16 --hardware h100-80gb-ndr
      paratrain plan --validate
    """
    if validate:
        return _validate(hardware, steps, renice, json_path)
    try:
        shape = build_shape(model, {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
                                    "seq": seq, "vocab": vocab, "mlp": mlp})
        profile = load_profile(hardware)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    explicit = any(layout_flags[name] is not None for name in LAYOUT_FLAGS)
    if explicit:
        layout = _layout(layout_flags, gpus)
        problems = layout_problems(shape, layout, global_batch, profile, gpus)
        if problems:
            raise Problems([f"this layout cannot run: {problem}" for problem in problems])
    elif gpus is None:
        raise click.UsageError("give --gpus to search, or a layout (--tp/--pp/--dp ...) to predict")
    custom = any((layers, hidden, heads, kv_heads, seq, vocab, mlp))
    click.echo(f"{model if not custom else 'MoE Llama' if shape.experts else 'Llama' if shape.gated else 'GPT'}: "
               + _shape_summary(shape) + f"; global batch {global_batch}")
    click.echo(f"hardware {profile.name}: {profile.description}")
    if explicit:
        results = [predict(shape, layout, profile, global_batch)]
        _echo(describe_prediction(results[0], shape, global_batch, profile))
    else:
        results = _search(shape, gpus, global_batch, profile, top)
    if json_path:
        json_path.write_text(json.dumps([p.to_json() for p in results], indent=1))
        click.echo(f"wrote {len(results)} layout(s) to {json_path}")


def _shape_summary(shape: GPTShape) -> str:
    """Parameters and the shape's letters; an MoE's active parameters and experts."""
    count = f"{format_count(shape.parameters())} parameters"
    if shape.experts:
        count += f", {format_count(shape.parameters(active=True))} active"
    letters = (f"l={shape.layers} h={shape.hidden} a={shape.heads} s={shape.seq} V={shape.vocab} m={shape.mlp}"
               + (f" g={shape.kv_heads}, SwiGLU" if shape.gated else ""))
    if shape.experts:
        letters += f"; E={shape.experts} k={shape.top_k} e={shape.expert_mlp}"
        letters += f" shared={shape.shared_experts}" if shape.shared_experts else ""
        letters += f", MoE in {shape.moe_layers} of {shape.layers} layers" if shape.moe_layers < shape.layers else ""
    return f"{count} ({letters})"


def _validate(hardware: str, steps: int, renice: int, json_path) -> None:
    """--validate: the cost model's predictions against measured training runs."""
    from paratrain.plan.validate import run_validation

    records = run_validation(hardware if Path(hardware).suffix else None, steps, renice)
    if json_path:
        json_path.write_text(json.dumps(records, indent=1))
        click.echo(f"wrote {len(records)} validation records to {json_path}")


def _search(shape, gpus: int, global_batch: int, profile, top: int) -> list:
    """Every valid layout of `gpus` devices that fits, fastest first, printed; the fastest in detail."""
    results, dropped = search(shape, gpus, global_batch, profile)
    click.echo(f"searched layouts of {gpus} devices, fastest first:")
    _echo(search_lines(results, dropped, top))
    if results:
        click.echo("the fastest in detail:")
        _echo(describe_prediction(results[0], shape, global_batch, profile))
    return results


def _echo(lines) -> None:
    for line in lines:
        click.echo(line)


def _layout(flags: dict, gpus: int | None) -> Layout:
    values = {name: flags[name] for name in LAYOUT_FLAGS if flags[name] is not None}
    values["sequence_parallel"] = bool(values.get("sequence_parallel"))
    layout = replace(Layout(), **{k: v for k, v in values.items() if k != "dp"})
    dp = values.get("dp") or (gpus // (layout.tp * layout.pp * layout.cp) if gpus else 1)
    layout = replace(layout, dp=max(dp, 1))
    if layout.schedule == "zb-v":
        layout = replace(layout, virtual_stages=2)
    return layout

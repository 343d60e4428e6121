"""`paratrain check`: does my parallel configuration train the same model as one process?

It trains a few steps of the given configuration and of the single-process reference on the
same initial weights and the same global batches, then prints the largest loss and parameter
differences and exits non-zero beyond tolerance. The default tolerances are for fp32: only
the order of floating-point sums differs, which moves results by ~1e-7 per step.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import click

from paratrain.cli_types import FiniteFloat
from paratrain.launch import run
from paratrain.parallel.data.strategy import strategy_of
from paratrain.environment import Settings
from paratrain.train.loop import train_rank
from paratrain.train.options import training_options, validated_config
from paratrain.train.reference import reference_run
from paratrain.train.setup import fsdp_units_note

FP32_LOSS_RTOL, FP32_PARAM_ATOL, FP32_PROGRESS_RTOL = 1e-5, 1e-5, 1e-3
# bf16 against the bf16 reference: only the order of sums and where bf16 rounds differ
# (measured ~2e-5 relative on losses). Loss values alone cannot tell a halved gradient from
# the right one over a few steps of a small learning rate, so the loss *decrease* over the
# run is compared too: a halved gradient moves it by ~25-50%, a run that never trains by 100%.
BF16_LOSS_RTOL, BF16_PARAM_ATOL, BF16_PROGRESS_RTOL = 1e-3, 1e-3, 5e-2


@dataclass(frozen=True)
class Tolerances:
    loss_rtol: float  # largest relative loss difference, any step
    param_atol: float  # largest absolute parameter difference, any rank
    progress_rtol: float  # relative difference of the loss decrease over the run


def tolerances(config) -> Tolerances:
    """The default tolerances of the configuration's precision."""
    if config.parallel.precision in ("bf16", "fp16"):  # fp16: the same rule (10 mantissa bits, bf16's 7)
        return Tolerances(BF16_LOSS_RTOL, BF16_PARAM_ATOL, BF16_PROGRESS_RTOL)
    return Tolerances(FP32_LOSS_RTOL, FP32_PARAM_ATOL, FP32_PROGRESS_RTOL)


def passes(report: dict, tolerance: Tolerances) -> bool:
    return (report["max_loss_diff"] <= tolerance.loss_rtol and report["max_param_diff"] <= tolerance.param_atol
            and report["progress_diff"] <= tolerance.progress_rtol and not report["missing"])


def compare(config, results: dict, reference) -> dict:
    """Largest relative loss difference per step, relative difference of the loss decrease
    over the run, and the largest absolute parameter difference on any rank. With clipping,
    the gradient norms before it are losses too: a norm off by a share too small to move the
    parameters beyond their tolerance in a few steps still fails the loss tolerance."""
    reference_losses, reference_state = reference.losses, reference.state
    log = results[min(results)]["log"]
    losses = [entry["loss"] for entry in log]
    loss_diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference_losses)]
    norms = [entry["grad_norm"] for entry in log if "grad_norm" in entry]
    norm_diffs = [0.0 if not math.isfinite(a) and not math.isfinite(b) else abs(a - b) / max(abs(b), 1e-12)
                  for a, b in zip(norms, reference.grad_norms)]  # fp16: both overflowed, both skipped
    progress_diff = 0.0
    if len(losses) >= 2:
        ours, ref = losses[0] - losses[-1], reference_losses[0] - reference_losses[len(losses) - 1]
        progress_diff = abs(ours - ref) / max(abs(ref), 1e-12)
    seen, worst, worst_diff = set(), None, 0.0
    for rank, result in sorted(results.items()):  # every replica, not only the last one merged
        for name, value in result["state"].items():
            if name not in reference_state:
                continue
            seen.add(name)
            diff = (value - reference_state[name]).abs().max().item()
            if worst is None or diff > worst_diff:
                worst, worst_diff = f"{name} (rank {rank})", diff
    return {
        "losses": losses, "reference_losses": reference_losses, "loss_diffs": loss_diffs,
        "max_loss_diff": max(loss_diffs + norm_diffs, default=0.0), "progress_diff": progress_diff,
        "skipped_steps": sum(bool(entry.get("skipped")) for entry in log),
        "reference_skipped_steps": reference.skipped_steps,
        "grad_norms": norms, "reference_grad_norms": reference.grad_norms, "max_grad_norm_diff": max(norm_diffs, default=0.0),
        "missing": sorted(set(reference_state) - seen), "max_param_diff": worst_diff, "worst_param": worst,
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@training_options
@click.option("--loss-rtol", type=FiniteFloat(min=0),
              help="Largest relative loss difference allowed (default 1e-5; bf16 1e-3).")
@click.option("--param-atol", type=FiniteFloat(min=0),
              help="Largest parameter difference allowed (default 1e-5; bf16 1e-3).")
@click.option("--progress-rtol", type=FiniteFloat(min=0),
              help="Largest relative difference of the loss decrease over the run (default 1e-3; bf16 5e-2).")
def check(config_path, loss_rtol, param_atol, progress_rtol, **flags):
    """Train a parallel configuration and the single-process reference side by side; exit 0
    only if losses and final parameters agree within tolerance.

    Takes the same options as `paratrain train` (default 5 steps).

    \b
    Example:
      paratrain check --model gpt-small --tp 2 --pp 4 --schedule 1f1b --microbatches 8
      paratrain check --model llama-tiny --tp 2 --pp 2 --dp 2 --microbatches 4 --sequence-parallel
      paratrain check --model my_model.py:build --plan my_plan.yaml --tp 2 --pp 2 --dp 2 --microbatches 4
    """
    if flags.get("steps") is None and not config_path:
        flags["steps"] = 5
    settings = Settings.resolve()
    config, world = validated_config(config_path, flags, settings)
    default = tolerances(config)
    loss_rtol = loss_rtol if loss_rtol is not None else default.loss_rtol
    param_atol = param_atol if param_atol is not None else default.param_atol
    progress_rtol = progress_rtol if progress_rtol is not None else default.progress_rtol
    par = config.parallel
    click.echo(
        f"check: {config.model.name}, world {world} = dp {world // par.replica_ranks} x pp {par.pp}"
        + (f" x cp {par.cp}" if par.cp > 1 else "") + f" x tp {par.tp}"
        + (f", {par.schedule} with {par.microbatches} microbatches" if par.pp > 1 else "")
        + f", {config.steps} steps, against one process"
    )
    if strategy_of(par).zero == 3:
        for line in fsdp_units_note(config):
            click.echo(line)
    results = run(functools.partial(train_rank, return_state=True), world, launcher=par.launcher,
                  args=(config,), timeout=par.timeout, debug=par.debug or None, settings=settings,
                  simulate_hosts=par.simulate_hosts)
    report = compare(config, results, reference_run(config))
    limits = Tolerances(loss_rtol, param_atol, progress_rtol)
    _print_report(config, report, limits)
    ok = passes(report, limits)
    if report["missing"]:
        click.echo(f"parameters no rank reported: {', '.join(report['missing'])}")
    click.echo("PASS: same model as one process" if ok else "FAIL: beyond tolerance")
    sys.exit(0 if ok else 1)


def _print_report(config, report: dict, limits: Tolerances) -> None:
    """Each step's loss beside the reference's, the largest differences against `limits`, and
    what clipping and fp16's skipped steps did on both sides."""
    click.echo(f"{'step':>5} {'loss':>12} {'reference':>12} {'rel. diff':>10}")
    for step, (ours, ref, diff) in enumerate(zip(report["losses"], report["reference_losses"], report["loss_diffs"])):
        click.echo(f"{step:>5} {ours:>12.7f} {ref:>12.7f} {diff:>10.2e}")
    click.echo(f"largest loss difference      {report['max_loss_diff']:.2e} "
               f"(relative; tolerance {limits.loss_rtol:g})")
    click.echo(f"loss decrease difference     {report['progress_diff']:.2e} "
               f"(relative; tolerance {limits.progress_rtol:g})")
    click.echo(f"largest parameter difference {report['max_param_diff']:.2e} in {report['worst_param']} "
               f"(absolute; tolerance {limits.param_atol:g})")
    norms = report["grad_norms"]
    if norms:  # a limit that never binds proves nothing about clipping
        limit = config.optim.clip_grad_norm
        click.echo(f"gradient norm before clipping {', '.join(f'{n:.5g}' for n in norms)} (reference "
                   f"{', '.join(f'{n:.5g}' for n in report['reference_grad_norms'])}; largest difference "
                   f"{report['max_grad_norm_diff']:.2e}, relative, counted as a loss's): clipped to {limit:g} "
                   f"on {sum(n > limit for n in norms)} of {len(norms)} steps")
    if config.parallel.precision == "fp16":
        click.echo(f"fp16 steps skipped after an overflow: {report['skipped_steps']} of {config.steps}, "
                   f"the reference's {report['reference_skipped_steps']}")
        if report["skipped_steps"] != report["reference_skipped_steps"]:
            # Not a fault of the layout: a weight's gradient sums over the tokens of one backward,
            # so micro-batches (pp, --grad-accum) overflow at twice the scale one batch does.
            click.echo("  (the overflow depends on the tokens one backward sums: with micro-batches it comes "
                       "at a larger scale; compare at a scale neither overflows, e.g. the default)")

"""`paratrain bench scaling`: weak and strong scaling over world sizes 1..N, as in the
ring-allreduce seed's benchmark.

Weak scaling keeps the batch per rank fixed (the global batch grows with N), strong scaling
keeps the global batch fixed (each rank's share shrinks). Both are timed with the DDP bench's
machinery (`Run`, `run_all`): one world per world size, weak and strong interleaved in it.
Speedup and efficiency are relative to the same mode's one-rank run.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import click
import torch

from paratrain.cli_types import OutputPath
from paratrain.bench.ddp import Run, check_configs, run_all, training_config, write_json
from paratrain.bench.simulated_hosts import checked_hosts, hosts_words, simulate_hosts_option
from paratrain.launch import LAUNCHERS, in_torchrun
from paratrain.models import MODEL_NAMES
from paratrain.parallel.data import DP_MODES
from paratrain.train.config import apply_overrides

MODES = ("weak", "strong")
JSON_KEYS = (
    "mode", "model", "dp_mode", "launcher", "world_size", "batch_per_rank", "global_batch", "steps",
    "warmup", "iter_ms", "iter_ms_stdev", "samples_per_s", "speedup", "efficiency", "comm_ms",
    "exposed_comm_ms", "cpu_count", "simulate_hosts",
)
DEFINITIONS = [
    "# weak:   batch per rank fixed; efficiency = t1/tN, speedup = N*t1/tN (throughput vs 1 rank)",
    "# strong: global batch fixed;   speedup = t1/tN, efficiency = speedup/N",
    "# (t1, tN: mean iteration time on 1 and N ranks; ideal: efficiency 1.00, speedup N)",
]


def world_sizes(max_nproc: int, nprocs_text: str | None) -> list[int]:
    """--nprocs if given (1 added: it is the baseline), else 1..--max-nproc."""
    if nprocs_text is None:
        return list(range(1, max_nproc + 1))
    try:
        sizes = sorted({int(n) for n in nprocs_text.split(",") if n.strip()})
    except ValueError:
        raise click.BadParameter(f"{nprocs_text!r} is not a comma-separated list of integers",
                                 param_hint="'--nprocs'") from None
    if not sizes or sizes[0] < 1:
        raise click.BadParameter(f"world sizes must be positive integers, got {nprocs_text!r}",
                                 param_hint="'--nprocs'")
    return sorted({1, *sizes})


def check_divisible(global_batch: int, sizes: list[int]) -> None:
    """Strong scaling splits one global batch evenly over every world size."""
    for n in sizes:
        if global_batch % n:
            step = math.lcm(*sizes)
            below, above = global_batch // step * step, (global_batch // step + 1) * step
            suggestion = f"{below} or {above}" if below else f"{above}"
            raise click.BadParameter(
                f"{global_batch} is not divisible by world size {n}; strong scaling needs a multiple"
                f" of {step} for world sizes {','.join(map(str, sizes))}, e.g. {suggestion}",
                param_hint="'--global-batch'")


def world_hosts(world_size: int, hosts: int) -> int:
    """The hosts a world of the benchmark plays: the one-rank baseline has no peer to cross to,
    so it runs alone whatever --simulate-hosts says."""
    return hosts if world_size > 1 else 0


def scaling_runs(sizes, modes, model, dp_mode, batch_size, global_batch, steps, warmup,
                 hosts: int = 0) -> dict[int, list[Run]]:
    """Per world size, its runs (one per mode), numbered across the whole benchmark."""
    runs, index, total = {}, 0, len(sizes) * len(modes)
    for n in sizes:
        runs[n] = []
        for mode in modes:
            batch = batch_size * n if mode == "weak" else global_batch
            index += 1
            config = apply_overrides(training_config(model, {}, dp_mode, batch, warmup + steps),
                                     {"parallel.simulate_hosts": world_hosts(n, hosts)})
            runs[n].append(Run(f"{mode} {model} {dp_mode} batch {batch}", config, warmup, index, total))
    return runs


def build_records(measured: dict[int, list[dict]], modes, *, model, dp_mode, launcher, batch_size,
                  global_batch, steps, warmup, hosts=0) -> list[dict]:
    """One record per (mode, world size), with speedup and efficiency against 1 rank."""
    records = []
    for m, mode in enumerate(modes):
        t1 = measured[1][m]["step_ms"]
        for n, runs in measured.items():
            t = runs[m]["step_ms"]
            batch = batch_size * n if mode == "weak" else global_batch
            speedup = n * t1 / t if mode == "weak" else t1 / t
            values = {
                "mode": mode, "model": model, "dp_mode": dp_mode, "launcher": launcher, "world_size": n,
                "batch_per_rank": batch // n, "global_batch": batch, "steps": steps, "warmup": warmup,
                "iter_ms": t, "iter_ms_stdev": runs[m]["step_ms_stdev"], "samples_per_s": batch / (t / 1e3),
                "speedup": speedup, "efficiency": t1 / t if mode == "weak" else speedup / n,
                "comm_ms": runs[m]["comm_ms"], "exposed_comm_ms": runs[m]["exposed_comm_ms"],
                "cpu_count": os.cpu_count(), "simulate_hosts": world_hosts(n, hosts),
            }
            records.append({key: values[key] for key in JSON_KEYS})
    return records


def table_lines(records: list[dict]) -> list[str]:
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in records):
        lines += [
            "#",
            f"# {mode} scaling",
            f"# {'world':>5}  {'batch/rank':>10}  {'global':>7}  {'iter_ms (mean ± stdev)':>22}"
            f"  {'samples/s':>10}  {'speedup':>7}  {'efficiency':>10}  {'comm_ms':>8}  {'exposed_ms':>10}",
        ]
        for r in (r for r in records if r["mode"] == mode):
            iteration = f"{r['iter_ms']:.2f} ± {r['iter_ms_stdev']:.2f}"
            lines.append(
                f"  {r['world_size']:>5}  {r['batch_per_rank']:>10}  {r['global_batch']:>7}  {iteration:>22}"
                f"  {r['samples_per_s']:>10,.0f}  {r['speedup']:>7.2f}  {r['efficiency']:>10.2f}"
                f"  {r['comm_ms']:>8.2f}  {r['exposed_comm_ms']:>10.2f}"
            )
    return lines


def write_plot(path: Path, records: list[dict], title: str) -> None:
    """Samples/s and efficiency against world size, one line per mode; the core count marked,
    since beyond it ranks time-share cores."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in dict.fromkeys(r["mode"] for r in records):
        rows = [r for r in records if r["mode"] == mode]
        sizes = [r["world_size"] for r in rows]
        left.plot(sizes, [r["samples_per_s"] for r in rows], marker="o", label=mode)
        right.plot(sizes, [r["efficiency"] for r in rows], marker="o", label=mode)
    right.axhline(1.0, color="grey", linewidth=0.8)
    for ax, label in ((left, "samples/s"), (right, "efficiency")):
        cores = os.cpu_count() or 1
        ax.axvline(cores, color="grey", linestyle="--", linewidth=0.8, label=f"{cores} cores")
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel(label)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(True, alpha=0.3)
        ax.legend()
    left.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


@click.command("scaling", epilog="\b\n" + "\n".join(line[2:] for line in DEFINITIONS))
@click.option("--mode", type=click.Choice(("weak", "strong", "both")), default="both", show_default=True,
              help="weak: fixed batch per rank; strong: fixed global batch; both, interleaved.")
@click.option("--model", type=click.Choice(MODEL_NAMES), default="mlp", show_default=True,
              help="Model preset to train (mlp: the seed's teacher-task Linear-GELU-Linear).")
@click.option("--dp-mode", type=click.Choice(DP_MODES), default="ddp", show_default=True,
              help="Data parallelism: naive, ddp (ours) or torch (PyTorch's DDP).")
@click.option("--launcher", type=click.Choice(LAUNCHERS), default="processes", show_default=True,
              help="processes: one process per rank (gloo); threads: the in-process fabric.")
@click.option("--max-nproc", type=click.IntRange(min=1), default=4, show_default=True,
              help="Largest world size: measures 1, 2, ..., this.")
@click.option("--nprocs", "nprocs_text", metavar="LIST",
              help="Comma-separated world sizes instead of --max-nproc, e.g. 1,2,4 (1 is always added).")
@click.option("--batch-size", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Weak scaling: samples per rank per step.")
@click.option("--global-batch", type=click.IntRange(min=1), default=3072, show_default=True,
              help="Strong scaling: samples per step over all ranks; must divide by every world size.")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True,
              help="Timed steps per run.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Steps before the timed ones, not counted.")
@click.option("--json", "json_path", type=OutputPath(path_type=Path),
              help="Also write one record per (mode, world size) to this file, with keys "
                   + ", ".join(JSON_KEYS) + ".")
@click.option("--plot", "plot_path", type=OutputPath(path_type=Path),
              help="Also draw samples/s and efficiency against world size into this PNG file.")
@simulate_hosts_option("Play N hosts on this machine (processes launcher), world/N consecutive ranks each (every "
                       "world above 1 must divide by N; the one-rank baseline runs alone): gradients are reduced "
                       "across hosts as on a cluster.")
def scaling(mode, model, dp_mode, launcher, max_nproc, nprocs_text, batch_size, global_batch, steps,
            warmup, json_path, plot_path, simulate_hosts) -> None:
    """Weak and strong scaling of data-parallel training over world sizes 1..N: iteration time,
    samples/s, speedup and efficiency against one rank.

    \b
    Examples:
      paratrain bench scaling --max-nproc 4 --model mlp
      paratrain bench scaling --mode strong --global-batch 4096 --nprocs 1,2,4 --plot scaling.png
      paratrain bench scaling --nprocs 2,4 --simulate-hosts 2
    """
    if in_torchrun():
        raise click.UsageError("bench scaling starts its own worlds of 1..N ranks; run it without torchrun")
    sizes = world_sizes(max_nproc, nprocs_text)
    modes = MODES if mode == "both" else (mode,)
    if "strong" in modes:
        check_divisible(global_batch, sizes)
    hosts = checked_hosts(simulate_hosts, launcher, [n for n in sizes if world_hosts(n, simulate_hosts)])
    runs = scaling_runs(sizes, modes, model, dp_mode, batch_size, global_batch, steps, warmup, hosts)
    for n, world_runs in runs.items():
        check_configs(world_runs, n)

    cores = os.cpu_count()
    alone = " (world 1 alone)" if hosts else ""
    click.echo(f"# paratrain bench scaling: {model}, dp-mode {dp_mode}, {launcher}{hosts_words(hosts)}{alone},"
               f" world sizes {','.join(map(str, sizes))}, {steps} timed steps after {warmup} warm-up")
    click.echo(f"# this machine has {cores} CPU cores (os.cpu_count()): above {cores} ranks, ranks share"
               f" cores, so efficiency there measures oversubscription more than communication")
    measured = {n: run_all(world_runs, n, launcher, world_runs[0].config.parallel.simulate_hosts)
                for n, world_runs in runs.items()}
    records = build_records(measured, modes, model=model, dp_mode=dp_mode, launcher=launcher,
                            batch_size=batch_size, global_batch=global_batch, steps=steps, warmup=warmup,
                            hosts=hosts)
    click.echo("\n".join([
        f"# torch {torch.__version__}, {measured[1][0]['torch_threads']} torch thread(s) per rank",
        *table_lines(records), "#", *DEFINITIONS,
    ]))
    if json_path:
        write_json(json_path, records)
        click.echo(f"# wrote {len(records)} records to {json_path}")
    if plot_path:
        write_plot(plot_path, records, f"{model} ({dp_mode}, {launcher}) on {cores} CPU cores")
        click.echo(f"# plotted to {plot_path}")

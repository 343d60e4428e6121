"""`paratrain bench ddp`: naive, our DDP, ZeRO and FSDP and PyTorch's side by side, same model, same world.

Every (model, mode) trains for a few steps through `train_rank`, with the same seed and data.
Modes run interleaved per model (naive, ddp, torch-ddp, naive, ddp, torch-ddp, ...) so that whatever
else the machine is doing falls on all of them alike. Times are rank 0's, averaged over the
steps after warm-up; with --repeats, each row is its median repeat. The ratio to torch is thus
measured in one run, on one machine: the figure this benchmark exists for.

`paratrain bench scaling` times its trainings with the same machinery: `Run`, `run_all`.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import torch

from paratrain.bench.simulated_hosts import checked_hosts, simulate_hosts_option
from paratrain.cli_types import FiniteFloat, OutputPath
from paratrain.launch import LAUNCHERS, in_torchrun, run
from paratrain.parallel.data.strategy import DP_MODES, STRATEGIES, resolve_strategy
from paratrain.environment import launch_environment
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.validate import problems_with

# name -> (model preset, overrides). The cnn-* rows are the profiling seed's tiny/small/medium
# flags; on the 8x8 digits images they have far fewer parameters than the seed's table claims
# (its images were larger), so the table prints the counts measured here.
MODELS = {
    "mlp": ("mlp", {}),  # the teacher MLP: seconds to run, what the tests use
    "cnn-tiny": ("cnn", {"channels": (16, 32), "hidden": 128}),
    "cnn-small": ("cnn", {"channels": (32, 64, 128), "hidden": 512}),
    "cnn-medium": ("cnn", {"channels": (64, 128, 256), "hidden": 2048}),
    "mlp16": ("mlp16", {}),  # 16 x Linear(1024, 1024): 16.8M parameters, 67 MB of gradients
    "gpt-tiny": ("gpt-tiny", {}),
    "gpt-small": ("gpt-small", {}),  # 8 blocks: FSDP's units
}
DEFAULT_MODELS = ("cnn-tiny", "cnn-small", "cnn-medium", "mlp16")
# The data-parallel strategies timed here, as --dp-mode spells them (parallel/data/strategy.py),
# each beside its PyTorch peer; local SGD is left out: its speed is its period's, not the strategy's.
BENCH_MODES = tuple(name for name in DP_MODES if resolve_strategy(name).name != "local-sgd")
DEFAULT_MODES = ("naive", "ddp", "torch-ddp")
JSON_KEYS = (
    "model", "params", "mode", "world_size", "launcher", "batch_per_rank", "global_batch", "steps",
    "warmup", "repeats", "step_ms", "step_ms_stdev", "ratio_to_torch", "ratio_to_ddp", "compute_ms", "comm_ms",
    "exposed_comm_ms", "comm_share", "samples_per_s", "repeat_step_ms",
)


@dataclass(frozen=True)
class Run:
    """One short training to time, and its place in the sequence (for the progress line)."""

    label: str
    config: TrainConfig
    warmup: int  # first steps left out of the timing: allocation, first touch, thread start-up
    index: int = 1
    total: int = 1


def training_config(model: str, overrides: dict, mode: str, global_batch: int, steps: int,
                    bucket_mb: float = 25.0, launcher: str = "processes") -> TrainConfig:
    """What `paratrain train` would run with these flags; everything else at its default."""
    config = apply_overrides(TrainConfig(), {
        "model.name": model, "parallel.dp_mode": mode, "data.global_batch": global_batch,
        "steps": steps, "parallel.bucket_mb": bucket_mb, "parallel.launcher": launcher,
    })
    config.model.overrides = dict(overrides)
    return config


def check_configs(runs: list[Run], world_size: int) -> None:
    """The training's own validation, before any rank starts; the first problem as a UsageError."""
    for r in runs:
        problems = problems_with(r.config, world_size)
        if problems:
            raise click.UsageError(f"{r.label}: {problems[0]}")


def timed_stats(log: list[dict]) -> dict:
    """Means over the timed steps of a training's per-step log."""
    step_ms = [entry["step_ms"] for entry in log]
    mean = lambda key: statistics.fmean(entry[key] for entry in log)  # noqa: E731
    return {
        "step_ms": statistics.fmean(step_ms), "step_ms_stdev": statistics.pstdev(step_ms),
        "compute_ms": mean("compute_ms"), "comm_ms": mean("comm_ms"),
        "exposed_comm_ms": mean("exposed_comm_ms"),
    }


@contextlib.contextmanager
def _quiet(active: bool):
    """Silence train_rank's progress bar and log lines: the benchmark prints its own."""
    if not active:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def train_runs(group, runs: list[Run]) -> list[dict]:
    """Rank function: train each run in turn; rank 0 prints one progress line per run."""
    progress = sys.stderr  # taken before _quiet swaps it (only rank 0 ever swaps it)
    measured = []
    for r in runs:
        with _quiet(group.rank == 0):
            result = train_rank(group, r.config)
        stats = timed_stats(result["log"][r.warmup:])
        stats.update(params=result["summary"]["params"], world_size=group.size,
                     torch_threads=torch.get_num_threads())
        measured.append(stats)
        if group.rank == 0:
            print(f"[{r.index}/{r.total}] {r.label} x{group.size}: {stats['step_ms']:.1f} ms/step"
                  f" (comm {stats['comm_ms']:.1f} ms, exposed {stats['exposed_comm_ms']:.1f} ms)",
                  file=progress, flush=True)
    return measured


def run_all(runs: list[Run], nproc: int, launcher: str, simulate_hosts: int = 0) -> list[dict] | None:
    """Each run's measurements on rank 0, in order; None on other ranks under torchrun.

    Processes: one world trains every run, as starting one costs seconds. Threads: a world per
    run, because a fabric can build PyTorch's gloo group for its threads only once (a second
    TorchDataParallel in the same world hangs), and starting threads costs nothing."""
    if launcher == "processes" or in_torchrun():
        return run(train_runs, nproc, launcher=launcher, args=(runs,), simulate_hosts=simulate_hosts).get(0)
    return [m for r in runs for m in run(train_runs, nproc, launcher=launcher, args=([r],))[0]]


def parse_names(text: str, valid, what: str, option: str) -> list[str]:
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise click.BadParameter(f"no {what} given; valid: {', '.join(valid)}", param_hint=f"'{option}'")
    for name in names:
        if name not in valid:
            raise click.BadParameter(f"unknown {what} {name!r}; valid: {', '.join(valid)}",
                                     param_hint=f"'{option}'")
    return names


def median_repeat(repeats: list[dict]) -> dict:
    """The repeat with the median step time (the faster middle one for an even count), whole,
    so that its columns agree with each other."""
    ordered = sorted(repeats, key=lambda m: m["step_ms"])
    return ordered[(len(ordered) - 1) // 2]


def build_records(models, modes, measured, *, launcher, batch_per_rank, steps, warmup, repeats) -> list[dict]:
    """One record per (model, mode) from the measurements, which come in run order."""
    by_key: dict[tuple[str, str], list[dict]] = {}
    queue = iter(measured)
    for model in models:
        for _ in range(repeats):
            for mode in modes:
                by_key.setdefault((model, mode), []).append(next(queue))
    records = []
    for model in models:
        for mode in modes:
            row = median_repeat(by_key[(model, mode)])
            peer = STRATEGIES[mode].peer
            torch_row = median_repeat(by_key[(model, peer)]) if peer in modes else None
            ddp_row = median_repeat(by_key[(model, "ddp")]) if "ddp" in modes else None
            world = row["world_size"]
            values = {
                **row, "model": model, "mode": mode, "launcher": launcher,
                "batch_per_rank": batch_per_rank, "global_batch": batch_per_rank * world,
                "steps": steps, "warmup": warmup, "repeats": repeats,
                "ratio_to_torch": row["step_ms"] / torch_row["step_ms"] if torch_row else None,
                "ratio_to_ddp": row["step_ms"] / ddp_row["step_ms"] if ddp_row else None,
                "comm_share": row["comm_ms"] / row["step_ms"],
                "samples_per_s": batch_per_rank * world / (row["step_ms"] / 1e3),
                "repeat_step_ms": [m["step_ms"] for m in by_key[(model, mode)]],
            }
            records.append({key: values[key] for key in JSON_KEYS})
    return records


def table_lines(records: list[dict]) -> list[str]:
    lines = [
        f"# {'model':<11} {'params':>11}  {'mode':<10} {'world':>5}  {'step_ms (mean ± stdev)':>22}"
        f"  {'vs torch':>8}  {'vs ddp':>6}  {'comm_ms':>8}  {'exposed_ms':>10}  {'comm share':>10}",
    ]
    for r in records:
        ratio = f"{r['ratio_to_torch']:.2f}x" if r["ratio_to_torch"] is not None else "-"
        to_ddp = f"{r['ratio_to_ddp']:.2f}x" if r["ratio_to_ddp"] is not None else "-"
        step = f"{r['step_ms']:.1f} ± {r['step_ms_stdev']:.1f}"
        lines.append(
            f"  {r['model']:<11} {r['params']:>11,}  {r['mode']:<10} {r['world_size']:>5}  {step:>22}"
            f"  {ratio:>8}  {to_ddp:>6}  {r['comm_ms']:>8.1f}  {r['exposed_comm_ms']:>10.1f}  {r['comm_share']:>10.0%}"
        )
    return lines


FOOTER = [
    "# vs torch   = step_ms / PyTorch's step_ms on the same model and world (below 1: faster): DDP for",
    "#              naive and ddp, DDP + ZeroRedundancyOptimizer for zero1 and zero2, FSDP2 (fully_shard)",
    "#              for fsdp; vs ddp = step_ms / our ddp's step_ms",
    "# comm_ms    = time the collectives ran (all-reduces; reduce-scatters and all-gathers for zero1",
    "#              and fsdp; summed; on a communication thread when they overlap compute);",
    "#              exposed_ms = time the training thread waited for them; comm share =",
    "#              comm_ms / step_ms. All measured, none estimated; PyTorch's FSDP2 is not timed (0).",
    "#              PyTorch DDP's all-reduces are timed by a communication hook (start to completion,",
    "#              as ours), but its exposed_ms differs in method: its reducer waits inside backward,",
    "#              so it is the time from its last gradient to the end of backward.",
]
WIRE_NOTE = ("# wire       = on processes of one host ours moves its messages through shared memory, PyTorch's"
             " DDP through gloo's sockets (PARATRAIN_SHM=0: both through the sockets)")
THREADS_NOTE = ("# launcher threads: naive and ddp (ours) communicate over the in-process fabric, PyTorch's DDP "
                "over a gloo group its threads share: not the same transport, so compare them with --launcher processes.")


def write_plot(path: Path, records: list[dict], title: str) -> None:
    """Step time per model and mode (log scale: models differ by orders of magnitude), and what
    share of it communication took, exposed part hatched."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter

    models = list(dict.fromkeys(r["model"] for r in records))
    modes = list(dict.fromkeys(r["mode"] for r in records))
    row = {(r["model"], r["mode"]): r for r in records}
    width = 0.8 / len(modes)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, mode in enumerate(modes):
        xs = [m + (i - (len(modes) - 1) / 2) * width for m in range(len(models))]
        rows = [row[(model, mode)] for model in models]
        bars = left.bar(xs, [r["step_ms"] for r in rows], width, label=mode)
        for bar, r in zip(bars, rows):
            if r["ratio_to_torch"] is not None:
                left.annotate(f"{r['ratio_to_torch']:.2f}x", (bar.get_x() + width / 2, bar.get_height()),
                              ha="center", va="bottom", fontsize=7)
        color = bars[0].get_facecolor()
        right.bar(xs, [100 * r["exposed_comm_ms"] / r["step_ms"] for r in rows], width, color=color,
                  alpha=0.6, label=mode)
        right.bar(xs, [100 * r["comm_share"] for r in rows], width, fill=False, edgecolor=color, linewidth=1.5)
    for ax, label in ((left, "step time (ms, log; labels: vs torch)"),
                      (right, "communication / step (%): outline all, filled exposed")):
        ax.set_xticks(range(len(models)), models)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    left.set_yscale("log")
    plain = LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5))  # "30", not "3x10^1"
    left.yaxis.set_major_formatter(plain)
    left.yaxis.set_minor_formatter(plain)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def write_json(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n")


def _flags(name: str) -> str:
    """A MODELS entry as `paratrain train` flags: 'cnn --channels 16 32 --hidden 128'."""
    preset, overrides = MODELS[name]
    show = lambda v: " ".join(map(str, v)) if isinstance(v, tuple) else str(v)  # noqa: E731
    return " ".join([f"--model {preset}", *(f"--{key} {show(value)}" for key, value in overrides.items())])


@click.command("ddp")
@click.option("--nproc", type=click.IntRange(min=1), default=2, show_default=True,
              help="Ranks (ignored under torchrun, which sets the world).")
@click.option("--launcher", type=click.Choice(LAUNCHERS), default="processes", show_default=True,
              help="processes: torch.distributed with gloo (what PyTorch DDP normally runs on); "
                   "threads: the in-process fabric.")
@click.option("--models", "models_text", default=",".join(DEFAULT_MODELS), show_default=True,
              help="Comma-separated models: " + ", ".join(f"{name} ({_flags(name)})" for name in MODELS) + ".")
@click.option("--modes", "modes_text", default=",".join(DEFAULT_MODES), show_default=True,
              help="Comma-separated data-parallel strategies (`paratrain train --dp-mode`): "
                   + ", ".join(BENCH_MODES) + ". Each is set beside its PyTorch peer when that runs too "
                   "(ddp beside torch-ddp, zero1 and zero2 beside torch-zero1, fsdp beside torch-fsdp); "
                   "torch-zero1 and torch-fsdp need processes; FSDP2's communication is not timed.")
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True,
              help="Samples per rank per step (the global batch is this times the world size).")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True,
              help="Timed steps per run.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Steps before the timed ones, not counted.")
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True,
              help="Runs per (model, mode), interleaved; each row is the median one.")
@click.option("--bucket-mb", type=FiniteFloat(min=0, min_open=True), default=25.0, show_default=True,
              help="Gradient bucket size in MiB for ddp and torch (PyTorch's default).")
@click.option("--json", "json_path", type=OutputPath(path_type=Path),
              help="Also write one record per (model, mode) to this file, with keys " + ", ".join(JSON_KEYS) + ".")
@click.option("--plot", "plot_path", type=OutputPath(path_type=Path),
              help="Also draw step time and communication share per model and mode into this PNG file.")
@simulate_hosts_option("Play N hosts on this machine (processes launcher), nproc/N consecutive ranks each: gradients "
                       "are reduced across hosts as on a cluster (our modes through hier where a host holds 2 or more).")
def ddp(nproc, launcher, models_text, modes_text, batch_size, steps, warmup, repeats, bucket_mb,
        json_path, plot_path, simulate_hosts) -> None:
    """Time naive data parallelism, our DDP and PyTorch's DDP side by side on the same model,
    world, seed and data, for a range of model sizes.

    \b
    Examples:
      paratrain bench ddp --nproc 2
      paratrain bench ddp --models mlp16 --modes ddp,torch --repeats 3 --json ddp.json
      paratrain bench ddp --nproc 4 --simulate-hosts 2 --models mlp16 --modes ddp,torch
    """
    models = parse_names(models_text, tuple(MODELS), "model", "--models")
    modes = parse_names(modes_text, BENCH_MODES, "mode", "--modes")
    modes = list(dict.fromkeys(resolve_strategy(mode).name for mode in modes))  # an alias names its strategy
    launched = launch_environment()
    world = launched.world_size if launched.in_torchrun else nproc
    hosts = checked_hosts(simulate_hosts, launcher, [nproc])
    runs = [
        Run(f"{model} {mode}", training_config(*MODELS[model], mode, batch_size * world, warmup + steps, bucket_mb,
                                               launcher),
            warmup)
        for model in models for _ in range(repeats) for mode in modes
    ]
    runs = [Run(r.label, r.config, r.warmup, i, len(runs)) for i, r in enumerate(runs, 1)]
    check_configs(runs, world)

    measured = run_all(runs, nproc, launcher, hosts)
    if measured is None:  # under torchrun, a rank other than 0: rank 0's process prints
        return
    records = build_records(models, modes, measured, launcher="torchrun" if in_torchrun() else launcher,
                            batch_per_rank=batch_size, steps=steps, warmup=warmup, repeats=repeats)
    title = (f"{world} ranks ({records[0]['launcher']}), batch {batch_size} per rank, {steps} timed steps"
             f" after {warmup} warm-up, median of {repeats}")
    click.echo("\n".join([
        f"# paratrain bench ddp: {title}",
        f"# {os.cpu_count()} CPU cores, torch {torch.__version__}, {measured[0]['torch_threads']} torch"
        f" thread(s) per rank, bucket {bucket_mb:g} MiB",
        *table_lines(records), *FOOTER, *([THREADS_NOTE] if launcher == "threads" and not in_torchrun() else [WIRE_NOTE]),
    ]))
    if json_path:
        write_json(json_path, records)
        click.echo(f"# wrote {len(records)} records to {json_path}")
    if plot_path:
        write_plot(plot_path, records, f"paratrain bench ddp: {title}")
        click.echo(f"# plotted to {plot_path}")

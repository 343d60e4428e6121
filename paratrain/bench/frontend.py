"""`paratrain bench frontend`: a training step through the frontend against the same step in
plain PyTorch in one process.

The step is a two-layer MLP (Linear(h, h) -> ReLU -> Linear(h, 10)), cross-entropy, backward,
an SGD step, and reading the loss (`.item()`: one round trip per step). Data stays where each
side computes (on the worker, in this process). Rounds alternate frontend / PyTorch so that
machine noise falls on both; each figure is the median of `--repeats` rounds. The worker uses
as many torch threads as this process does.

Beside the step it measures the frontend's two costs: one streamed instruction (many tiny
operations, then one sync) and one round trip (an empty sync). The overhead per instruction is
(frontend step - PyTorch step) / instructions per step.

With `--compile`, the step is measured eager and compiled through the frontend, beside plain
PyTorch (frontend_compile.py).
"""

from __future__ import annotations

import json
import statistics
import time

import click
import torch

from paratrain.bench.frontend_steps import ROUND_SECONDS, frontend_step, seconds_per_step, torch_step
from paratrain.cli_types import OutputPath

SIZES = ((32, 128), (256, 1024), (1024, 2048))


def measure_size(gt, session, batch: int, hidden: int, repeats: int, steps: int | None) -> dict:
    ours, theirs = frontend_step(gt, batch, hidden), torch_step(batch, hidden)
    for step in (ours, theirs, ours, theirs):  # warm-up: caches, allocator, first sync
        step()
    if steps is None:
        steps = max(3, int(ROUND_SECONDS / seconds_per_step(theirs, 2)))
    before = session._seq
    ours()
    instructions = session._seq - before - 1  # the sync token is not an instruction
    frontend_s, torch_s = [], []
    for _ in range(repeats):
        frontend_s.append(seconds_per_step(ours, steps))
        torch_s.append(seconds_per_step(theirs, steps))
    frontend_ms, torch_ms = statistics.median(frontend_s) * 1e3, statistics.median(torch_s) * 1e3
    return {"batch": batch, "hidden": hidden, "workers": session.n_workers, "frontend_ms": frontend_ms,
            "torch_ms": torch_ms, "ratio": frontend_ms / torch_ms, "steps": steps,
            "instructions_per_step": instructions,
            "overhead_us_per_instruction": (frontend_ms - torch_ms) * 1e3 / instructions}


def measure_costs(gt, session, repeats: int) -> dict:
    """(one streamed instruction in us, one round trip in ms), medians."""
    x = gt.ones(1)
    streamed, round_trips = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(2000):
            x + 1.0  # noqa: B018 - the instruction is the point; its result is freed at once
        session.sync()
        streamed.append((time.perf_counter() - started) / 2000 * 1e6)
        started = time.perf_counter()
        for _ in range(100):
            session.sync()
        round_trips.append((time.perf_counter() - started) / 100 * 1e3)
    return {"streamed_instruction_us": statistics.median(streamed), "round_trip_ms": statistics.median(round_trips)}


def _parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        batch, sep, hidden = item.strip().partition("x")
        if not sep or not batch.isdigit() or not hidden.isdigit() or int(batch) < 1 or int(hidden) < 1:
            raise click.BadParameter(f"sizes look like BATCHxHIDDEN,..., got {item!r}")
        sizes.append((int(batch), int(hidden)))
    return sizes


def _report(gt, session, sizes, repeats: int, steps: int | None) -> list[dict]:
    costs = measure_costs(gt, session, repeats)
    click.echo(f"one streamed instruction: {costs['streamed_instruction_us']:.1f} us; "
               f"one round trip (sync): {costs['round_trip_ms']:.3f} ms")
    click.echo(f"{'batch':>6} {'hidden':>7} {'instr/step':>10} {'frontend ms':>12} {'torch ms':>9} "
               f"{'ratio':>7} {'overhead/instr':>15}")
    records = []
    for batch, hidden in sizes:
        record = {**measure_size(gt, session, batch, hidden, repeats, steps), **costs}
        records.append(record)
        click.echo(f"{batch:>6} {hidden:>7} {record['instructions_per_step']:>10} "
                   f"{record['frontend_ms']:>12.2f} {record['torch_ms']:>9.2f} {record['ratio']:>6.2f}x "
                   f"{record['overhead_us_per_instruction']:>12.1f} us")
    return records


@click.command()
@click.option("--sizes", default=None,
              help=f"Comma-separated BATCHxHIDDEN pairs [default: {','.join(f'{b}x{h}' for b, h in SIZES)}; "
                   "with --compile 256x1024,1024x2048].")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1),
              help="Workers to start (ignored with --server).")
@click.option("--server", default=None, help="Use a running dispatcher HOST:PORT instead of starting one.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1), help="Alternating rounds per size.")
@click.option("--steps", type=click.IntRange(1), default=None,
              help="Steps per round (default: about 0.4 s of PyTorch per round).")
@click.option("--compile", "compiled", is_flag=True,
              help="Also run the step with its forward in a compiled region (compile: true), side by side.")
@click.option("--json", "json_path", type=OutputPath(), default=None,
              help="Write one record per size: batch, hidden, workers, frontend_ms, torch_ms, ratio, ...")
def frontend(sizes, workers, server, repeats, steps, compiled, json_path):
    """A two-layer MLP training step through the frontend vs plain PyTorch in one process."""
    import paratrain.frontend as gt
    from paratrain.bench import frontend_compile

    default = frontend_compile.SIZES if compiled else SIZES
    sizes = _parse_sizes(sizes or ",".join(f"{b}x{h}" for b, h in default))
    session = gt.connect(server) if server else gt.start(workers)
    try:
        click.echo(f"paratrain bench frontend: {session.n_workers} worker(s) at {session.address}; "
                   f"torch threads here: {torch.get_num_threads()}; median of {repeats} alternating rounds")
        if compiled:
            records = frontend_compile.report(gt, session, sizes, repeats, steps)
        else:
            records = _report(gt, session, sizes, repeats, steps)
    finally:
        gt.disconnect()
    if json_path:
        with open(json_path, "w") as out:
            json.dump(records, out, indent=2)
        click.echo(f"wrote {json_path}")

"""`paratrain bench frontend --compile`: the same MLP training step eager and compiled through
the frontend, beside plain PyTorch in one process, eager and with the same forward compiled (so
the table shows what compiling gains without the frontend, and what the frontend costs).

The compiled step puts the forward pass (Linear -> ReLU -> Linear -> cross-entropy) in a region
whose signal says `compile: true`, so the worker runs it, and its backward, as torch.compile'd
code from the region's second execution on; backward, the SGD step and reading the loss stay
as they are. Warm-up runs the compiled step until its forward and backward are compiled (the
compile takes seconds and is not timed). Rounds alternate the three so that machine noise
falls on all of them; each figure is the median of `--repeats` rounds.
"""

from __future__ import annotations

import statistics

import click

from paratrain.bench import frontend_steps
from paratrain.bench.frontend_steps import ROUND_SECONDS, frontend_step, seconds_per_step
from paratrain.environment import Settings

SIZES = ((256, 1024), (1024, 2048))
REGION = "bench_compiled_forward"
WARM_UP_STEPS = 4  # seen once, compiled (forward, then backward at its first use), reused twice


def measure_compiled(gt, session, batch: int, hidden: int, repeats: int, steps: int | None) -> dict:
    gt.register_config(REGION, gt.SignalConfig(compile=True))
    eager, torch_step = frontend_step(gt, batch, hidden), frontend_steps.torch_step(batch, hidden)
    # the workers' backend (PARATRAIN_COMPILE_BACKEND, as this process reads it too)
    torch_compiled = frontend_steps.torch_step(batch, hidden, compiled=True, backend=Settings.resolve().compile_backend)
    compiled = frontend_step(gt, batch, hidden, region=gt.signal.context, name=REGION)
    before = _counts(gt, session)
    for _ in range(WARM_UP_STEPS):
        compiled(), torch_compiled()
    eager(), torch_step(), eager(), torch_step()
    if steps is None:
        steps = max(3, int(ROUND_SECONDS / seconds_per_step(torch_step, 2)))
    steps_of = {"frontend": eager, "compiled": compiled, "torch": torch_step, "torch_compiled": torch_compiled}
    times = {name: [] for name in steps_of}
    for _ in range(repeats):
        for name, step in steps_of.items():
            times[name].append(seconds_per_step(step, steps))
    after = _counts(gt, session)
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return {"batch": batch, "hidden": hidden, "workers": session.n_workers, "frontend_ms": ms["frontend"],
            "compiled_ms": ms["compiled"], "torch_ms": ms["torch"], "torch_compiled_ms": ms["torch_compiled"],
            "compiled_vs_torch": ms["compiled"] / ms["torch"],
            "torch_compiled_vs_torch": ms["torch_compiled"] / ms["torch"],
            "compiled_vs_frontend": ms["compiled"] / ms["frontend"], "steps": steps,
            "compiled_runs": after["compiled_runs"] - before["compiled_runs"],
            "compile_failures": after["failures"] - before["failures"]}


def _counts(gt, session) -> dict:
    """The home worker's compile counts now (a tensor made there makes the sync ask it)."""
    with gt.worker(session.home):
        gt.zeros(1)
    session.sync()
    return session.worker_stats[session.home]["compile"]


def report(gt, session, sizes, repeats: int, steps: int | None) -> list[dict]:
    click.echo(f"{'batch':>6} {'hidden':>7} {'frontend ms':>12} {'compiled ms':>12} {'torch ms':>9} "
               f"{'torch compiled ms':>18} {'compiled/torch':>15} {'torch compiled/torch':>21} {'compiled runs':>14}")
    records = []
    for batch, hidden in sizes:
        record = measure_compiled(gt, session, batch, hidden, repeats, steps)
        records.append(record)
        failed = f"  ({record['compile_failures']} compile failures: ran eagerly)" if record["compile_failures"] else ""
        click.echo(f"{batch:>6} {hidden:>7} {record['frontend_ms']:>12.2f} {record['compiled_ms']:>12.2f} "
                   f"{record['torch_ms']:>9.2f} {record['torch_compiled_ms']:>18.2f} "
                   f"{record['compiled_vs_torch']:>14.2f}x {record['torch_compiled_vs_torch']:>20.2f}x "
                   f"{record['compiled_runs']:>14}{failed}")
    return records

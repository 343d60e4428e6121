"""`paratrain bench pipeline`: our pipeline runtime against torch.distributed.pipelining.

Both run the same GPT chunks (our balanced split) on the same microbatches, one process per
stage, in one launch, alternating step by step so that machine noise hits both alike. Ours
runs each schedule asked for and reports its measured bubble (of ranks x the step's time,
the share not spent computing; the median over the timed steps) beside the schedule's
theoretical one; PyTorch's Schedule1F1B (and ScheduleGPipe) is the reference for step time.
Only forward and backward are timed: no optimizer step.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import click
import torch

from paratrain.bench.simulated_hosts import checked_hosts, hosts_words, simulate_hosts_option
from paratrain.cli_types import OutputPath
from paratrain.launch import run
from paratrain.parallel.pipeline.runtime import PipelineRuntime
from paratrain.parallel.pipeline.schedules import SCHEDULES, build_schedule
from paratrain.parallel.pipeline.simulate import simulate, theoretical_bubble
from paratrain.parallel.pipeline.split import pipeline_layers, split_layers
from paratrain.train.setup import build_seeded_model, dataset_for

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def _torch_step_fn(chunk, rank, stages, microbatches, loss_fn, name):
    import torch.distributed.pipelining as pipelining

    stage = pipelining.PipelineStage(chunk, rank, stages, torch.device("cpu"))
    schedule = getattr(pipelining, TORCH_SCHEDULES[name])(stage, microbatches, loss_fn=loss_fn)

    def step(inputs, targets):
        if rank == 0:
            schedule.step(inputs)
        elif rank == stages - 1:
            schedule.step(target=targets)
        else:
            schedule.step()

    return step


def bench_rank(group, model_name, schedules, microbatches, global_batch, steps, warmup):
    """Runs on every rank; rank 0 returns one record per (implementation, schedule)."""
    mine, runners = _runners(group, model_name, schedules, microbatches, global_batch)
    measured = _timed(group, mine, runners, microbatches, steps, warmup)
    # Per runner and rank, per step: its time, compute time, and mean time per F, B and W.
    gathered = torch.tensor(measured, dtype=torch.float64)
    everyone = torch.empty(group.size * gathered.numel(), dtype=torch.float64)
    group.all_gather(everyone, gathered.view(-1), algo="native")
    per_rank = everyone.view(group.size, len(runners), 5, steps)  # rank, runner, what, step
    return [_record(impl, name, per_rank[:, index], group.size, microbatches, steps)
            for index, (impl, name, _) in enumerate(runners)]


def _runners(group, model_name, schedules, microbatches, global_batch):
    """This rank's chunk, and (implementation, schedule, a step's call) for each runner: ours for
    every schedule with one chunk per rank, PyTorch's for those it has."""
    model = build_seeded_model(model_name, {}, 0)
    dataset = dataset_for(model_name, {}, None, 0)
    chunks = split_layers(pipeline_layers(model), group.size)
    mine = chunks[group.rank]
    inputs, targets = dataset.global_batch(0, global_batch)
    runners = []
    for name in schedules:
        schedule = build_schedule(name, group.size, microbatches)
        if schedule.num_chunks != group.size:
            continue  # schedules with several chunks per rank need another split
        runtime = PipelineRuntime(schedule, group.rank, {group.rank: mine}, group, dataset.loss)
        micro_in, micro_out = list(inputs.chunk(microbatches)), list(targets.chunk(microbatches))
        runners.append(("paratrain", name, lambda r=runtime, a=micro_in, b=micro_out: r.run(a, b)))
        if name in TORCH_SCHEDULES:
            step = _torch_step_fn(mine, group.rank, group.size, microbatches, dataset.loss, name)
            runners.append(("torch.pipelining", name, lambda s=step: s(inputs, targets)))
    return mine, runners


def _timed(group, mine, runners, microbatches, steps, warmup) -> list[list[float]]:
    """Every runner's timed steps on this rank, runners alternating step by step: per runner, its
    step times, compute times (-1 for PyTorch's, which does not say) and mean F, B, W times."""
    times = {(impl, name): [] for impl, name, _ in runners}
    busy = {(impl, name): [] for impl, name, _ in runners}  # this rank's compute seconds per step
    action_s = {(impl, name): [] for impl, name, _ in runners}  # per step: mean seconds per F, B and W
    for iteration in range(warmup + steps):
        for impl, name, fn in runners:  # alternate: noise falls on every runner alike
            group.barrier("native")
            started = time.perf_counter()
            stats = fn()
            elapsed = time.perf_counter() - started
            mine.zero_grad(set_to_none=True)
            if iteration >= warmup:
                times[(impl, name)].append(elapsed)
                if stats:
                    busy[(impl, name)].append(stats["busy_s"])
                    action_s[(impl, name)].append([stats["op_s"][op] / microbatches for op in "FBW"])
    return [[*times[k], *(busy[k] or [-1.0] * steps),
             *(step[op] for op in range(3) for step in (action_s[k] or [[-1.0] * 3] * steps))]
            for k in times]


def _record(impl: str, name: str, runner: torch.Tensor, stages: int, microbatches: int, steps: int) -> dict:
    """One runner's record from every rank's measurements (runner[rank, what, step])."""
    step_s = runner[:, 0].max(dim=0).values  # a step lasts until its slowest rank ends
    busy_s = runner[:, 1]
    actions_s = runner[:, 2:]  # rank, F/B/W, step
    ours = busy_s.min() >= 0
    # The bubble as theory counts it: of p ranks x the step's time, the share not computing. (A
    # rank's own time would flatter it: the last stage finishes a backward before the first.)
    bubble = (1 - busy_s.sum(dim=0) / (stages * step_s)).tolist()
    # Medians over the timed steps, as `bench tp` reports: on a shared machine a few steps
    # in which one rank's core ran slow would otherwise stand for the schedule. The means
    # are kept beside them.
    return {
        "impl": impl, "schedule": name, "stages": stages, "microbatches": microbatches,
        "step_ms": statistics.median(step_s.tolist()) * 1e3,
        "step_ms_mean": step_s.mean().item() * 1e3,
        "bubble_measured": statistics.median(bubble) if ours else None,
        "bubble_measured_mean": statistics.fmean(bubble) if ours else None,
        "bubble_simulated": statistics.median(
            _simulated_bubble(name, stages, microbatches, actions_s[:, :, step]) for step in range(steps)
        ) if ours else None,
        "bubble_theoretical": theoretical_bubble(name, stages, microbatches, 1),
        "bubble_theoretical_costs": _balanced_bubble(name, stages, microbatches, actions_s.mean(dim=2)) if ours else None,
    }


def _balanced_bubble(name: str, stages: int, microbatches: int, action_s: torch.Tensor) -> float:
    """The schedule's bubble with equal stages at this model's own F:B:W (each the mean over the
    stages) and free communication: theory for this model. GPipe's and 1F1B's bubbles do not
    depend on the ratio; a zero-bubble schedule's do (ZB-H1 idles (p-1)(F+B-W) per rank, Qi et
    al. 2023, so a W cheaper than B leaves more than the unit-cost figure)."""
    means = action_s.mean(dim=0).tolist()
    return simulate(build_schedule(name, stages, microbatches),
                    {op: [means[i]] * stages for i, op in enumerate("FBW")}).bubble


def _simulated_bubble(name: str, stages: int, microbatches: int, action_s: torch.Tensor) -> float:
    """The schedule's bubble with this run's measured compute time per action on each stage
    (action_s[rank] = mean F, B, W seconds) and communication free: what the stages' imbalance
    alone leaves idle. The measured bubble's excess over it is communication and the runtime."""
    costs = {op: action_s[:, i].tolist() for i, op in enumerate("FBW")}
    return simulate(build_schedule(name, stages, microbatches), costs).bubble


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--nproc", type=int, default=2, show_default=True, help="Pipeline stages, one process (or thread) each.")
@click.option("--model", default="gpt-small", show_default=True, help="A GPT preset (split by our balanced partition).")
@click.option("--schedules", default="gpipe,1f1b,zb-h1", show_default=True,
              help=f"Our schedules to run, from: {', '.join(SCHEDULES)} (one chunk per rank only).")
@click.option("--microbatches", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--global-batch", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True, help="Timed steps per runner.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed steps per runner first.")
@click.option("--json", "json_path", type=OutputPath(), help="Write the records as JSON.")
@simulate_hosts_option("Play N hosts on this machine, nproc/N consecutive stages each: activations and gradients "
                       "pass between hosts through gloo, inside one through shared memory, as on a cluster.")
def pipeline(nproc, model, schedules, microbatches, global_batch, steps, warmup, json_path, simulate_hosts):
    """Our pipeline runtime vs torch.distributed.pipelining on the same GPT stages.

    Prints step time (slowest rank, forward + backward of all microbatches), the ratio to
    PyTorch's schedule of the same name, and our measured bubble beside the theoretical one:
    medians over the timed steps (the bubble's mean too). Runs on processes
    (torch.distributed.pipelining needs torch's default process group).
    """
    launcher = "processes"
    names = [s.strip() for s in schedules.split(",") if s.strip()]
    bad = [s for s in names if s not in SCHEDULES]
    if bad:
        raise click.BadParameter(f"unknown schedule(s) {', '.join(bad)}; valid: {', '.join(SCHEDULES)}", param_hint="--schedules")
    if nproc < 2:
        raise click.BadParameter("a pipeline needs at least 2 stages", param_hint="--nproc")
    if global_batch % microbatches:
        raise click.BadParameter(f"global batch {global_batch} is not divisible by {microbatches} microbatches")
    for name in names:
        try:
            build_schedule(name, nproc, microbatches)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--schedules") from None
    hosts = checked_hosts(simulate_hosts, launcher, [nproc])
    click.echo(f"# pipeline: {model}, {nproc} stages, one process each{hosts_words(hosts)}, {microbatches} "
               f"microbatches of {global_batch // microbatches}, {steps} timed steps; this machine has "
               f"{os.cpu_count()} cores")
    records = run(bench_rank, nproc, launcher=launcher,
                  args=(model, names, microbatches, global_batch, steps, warmup), simulate_hosts=hosts)[0]
    reference = {r["schedule"]: r["step_ms"] for r in records if r["impl"] == "torch.pipelining"}
    click.echo(f"{'impl':<17} {'schedule':<9} {'step ms':>9} {'vs torch':>9} {'bubble measured':>16} "
               f"{'(mean)':>7} {'simulated':>10} {'theory F:B:W':>13} {'theoretical':>12}")
    for record in records:
        ratio = record["step_ms"] / reference[record["schedule"]] if record["schedule"] in reference else None
        record["ratio_to_torch"] = ratio
        measured, mean, simulated, costs = (
            f"{record[key]:.1%}" if record[key] is not None else "-"
            for key in ("bubble_measured", "bubble_measured_mean", "bubble_simulated", "bubble_theoretical_costs"))
        click.echo(f"{record['impl']:<17} {record['schedule']:<9} {record['step_ms']:>9.1f} "
                   f"{(f'{ratio:.2f}x' if ratio else '-'):>9} {measured:>16} {mean:>7} {simulated:>10} {costs:>13} "
                   f"{record['bubble_theoretical']:>11.1%}")
    click.echo(f"# step ms and bubbles: medians over {steps} timed step{'s' * (steps != 1)} "
               "(the measured bubble's mean beside it)")
    click.echo("# vs torch: our step time / torch.distributed.pipelining's for the same schedule (lower is faster)")
    click.echo("# bubble: measured = share of the step's time x ranks not spent computing (the step ends with its")
    click.echo("#   slowest rank, as in theory); simulated = the schedule played with each step's mean F/B/W")
    click.echo("#   time per stage and free communication (the stages' imbalance alone); theory F:B:W = equal")
    click.echo("#   stages at this run's mean F, B and W (the model's own ratio); theoretical = equal stages,")
    click.echo("#   B = 2F (split: B = W = F). measured - simulated: communication and the runtime's own time.")
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(records, handle, indent=1)
        click.echo(f"# records written to {json_path}", err=True)
    sys.stdout.flush()

"""`paratrain schedule`: show a pipeline schedule, its bubble and its memory, without a model.

It prints exactly what the runtime would execute (the same `build_schedule` lists), played
forward by `simulate` with unit costs.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from paratrain.cli_types import OutputPath
from paratrain.errors import Problems
from paratrain.parallel.pipeline.schedules import SCHEDULES, Schedule, build_schedule, microbatch_problems
from paratrain.parallel.pipeline.simulate import Timeline, simulate, theoretical_bubble
from paratrain.parallel.pipeline.timeline import draw_timeline, format_timeline

_FORMULAS = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved-1f1b": "(p-1)/(v*m+p-1)"}


def default_virtual_stages(name: str) -> int:
    return 2 if name in ("interleaved-1f1b", "zb-v") else 1


def schedule_record(schedule: Schedule, timeline: Timeline) -> dict:
    """The --json document: the per-rank lists the runtime executes, and the simulated bubble."""
    return {
        "schedule": schedule.name,
        "stages": schedule.stages,
        "microbatches": schedule.microbatches,
        "virtual_stages": schedule.virtual_stages,
        "bubble": timeline.bubble,
        "ranks": [[{"op": a.op, "microbatch": a.microbatch, "stage": a.stage} for a in rank]
                  for rank in schedule.ranks],
    }


def bubble_line(schedule: Schedule, timeline: Timeline) -> str:
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    simulated = f"bubble: {timeline.bubble:.1%} simulated"
    if schedule.name in _FORMULAS:
        theory = theoretical_bubble(schedule.name, p, m, v)
        return f"{simulated}, {theory:.1%} theoretical {_FORMULAS[schedule.name]}"
    # Zero-bubble schedules have no textbook figure at every size; 1F1B is the yardstick.
    return (f"{simulated} (no textbook formula for {schedule.name}; "
            f"1f1b at these sizes: {theoretical_bubble('1f1b', p, m):.1%})")


# Each of p ranks runs v*m forward and backward parts, and a timeline's time and memory grow
# with them: these bounds keep one within seconds and a few hundred MB.
MAX_STAGES, MAX_MICROBATCHES, MAX_VIRTUAL_STAGES = 64, 1024, 8
MAX_PARTS = 16_384  # stages x virtual stages x microbatches


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--schedule", "name", default="1f1b", show_default=True, metavar="NAME",
              help=f"The pipeline schedule: {', '.join(SCHEDULES)}.")
@click.option("--stages", type=click.IntRange(1, MAX_STAGES), default=4, show_default=True,
              help=f"Pipeline ranks p, 1 to {MAX_STAGES}; the model is cut into p stages (p*v chunks).")
@click.option("--microbatches", type=click.IntRange(1, MAX_MICROBATCHES), default=8, show_default=True,
              help=f"Microbatches m that one optimizer step's batch is split into, 1 to {MAX_MICROBATCHES}.")
@click.option("--virtual-stages", type=click.IntRange(1, MAX_VIRTUAL_STAGES), default=None,
              help="Model chunks per rank v. interleaved-1f1b: 2 or more (default 2); "
                   f"zb-v: always 2; the others: 1. At most {MAX_VIRTUAL_STAGES}.")
@click.option("--png", type=OutputPath(path_type=Path), default=None,
              help="Also draw the timeline as a Gantt chart PNG at this path.")
@click.option("--json", "json_path", type=OutputPath(path_type=Path), default=None,
              help='Write {"schedule", "stages", "microbatches", "virtual_stages", "bubble", "ranks"} '
                   'here; ranks[r] is rank r\'s ordered list of {"op", "microbatch", "stage"}, '
                   "stage being the model chunk.")
def schedule(name, stages, microbatches, virtual_stages, png, json_path):
    """Print a pipeline schedule as a timeline, with its bubble and peak memory.

    Nothing runs: these are the per-rank action lists `paratrain train --pp` executes, timed with
    unit costs (a backward costs two forwards; split, B and W cost one each) and free
    communication.

    \b
    Notation, one line per pipeline rank ("Stage r"), one column per unit of time:
      F3      forward of microbatch 3
      B3      backward of microbatch 3 (drawn B3--- over the two columns it takes);
              in zb-h1 and zb-v only its input-gradient half, one column
      W3      the weight-gradient half of the backward (zb-h1, zb-v)
      F3.1    microbatch 3 on the rank's second model chunk (interleaved-1f1b, zb-v)
      blank   the rank is idle: the pipeline bubble
    Bubble = idle share of all ranks' time. Peak in flight = the most microbatch-chunks a
    rank holds activations for (forward done, last backward part not yet).

    \b
    Examples:
      paratrain schedule --schedule 1f1b --stages 4 --microbatches 8
      paratrain schedule --schedule interleaved-1f1b --stages 4 --microbatches 8 --virtual-stages 2
      paratrain schedule --schedule zb-v --stages 4 --microbatches 8 --png zbv.png --json zbv.json

    Limits: stages x virtual stages x microbatches at most 16,384.
    """
    if virtual_stages is None:
        virtual_stages = default_virtual_stages(name)
    problems = microbatch_problems(name, stages, microbatches, virtual_stages)
    if stages * virtual_stages * microbatches > MAX_PARTS:
        problems.append(f"stages x virtual stages x microbatches is {stages * virtual_stages * microbatches:,}; "
                        f"a timeline draws at most {MAX_PARTS:,}")
    if problems:
        raise Problems(problems)
    built = build_schedule(name, stages, microbatches, virtual_stages)
    timeline = simulate(built)
    chunks = f", {built.virtual_stages} model chunks per stage" if built.virtual_stages > 1 else ""
    click.echo(f"{name}: {stages} stages, {microbatches} microbatches{chunks}")
    click.echo(format_timeline(built, timeline))
    click.echo(bubble_line(built, timeline))
    click.echo("peak activations in flight (microbatch-chunks): "
               + ", ".join(f"Stage {r}: {n}" for r, n in enumerate(timeline.peak_in_flight)))
    if png:
        click.echo(f"timeline drawn to {draw_timeline(built, png, timeline)}")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(schedule_record(built, timeline), indent=1) + "\n")
        click.echo(f"schedule written to {json_path}")

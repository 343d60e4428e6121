"""A schedule as a picture: text, one line per pipeline rank in the style of the GT seed's
`Stage 0: F0 F1 F2 F3 B0 ...`, and a Gantt chart PNG.

Both come from `simulate` with its default costs, so columns are time: one column is the time
of one forward through one chunk, a blank column is a rank sitting idle (the bubble), and an
action that takes longer (an unsplit backward takes two) is drawn on as `B0---`.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.parallel.pipeline.schedules import Action, Schedule
from paratrain.parallel.pipeline.simulate import Timeline, simulate

_COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}  # forward blue, input grad orange, weight grad green


def action_label(schedule: Schedule, rank: int, action: Action) -> str:
    """`F3`, or with several chunks per rank `F3.1`: microbatch 3 on the rank's second chunk."""
    label = f"{action.op}{action.microbatch}"
    if schedule.virtual_stages > 1:
        label += f".{schedule.chunks_of(rank).index(action.stage)}"
    return label


def legend(schedule: Schedule) -> list[str]:
    """What the letters, numbers and gaps of `format_timeline` mean, for this schedule."""
    if schedule.split_backward:
        ops = "F = forward, B = backward to the input (input gradient), W = backward to the weights"
        durations = "every action takes one column"
    else:
        ops = "F = forward, B = backward"
        durations = "a backward takes two columns (B0---)"
    lines = [f"legend: {ops}; the number is the microbatch; one column = one forward through one "
             f"model chunk, {durations}; blank = idle (the bubble)"]
    if schedule.virtual_stages > 1:
        held = "; ".join(f"Stage {r}: {', '.join(map(str, schedule.chunks_of(r)))}"
                         for r in range(schedule.stages))
        lines.append(f"chunks: F3.1 = microbatch 3 on the stage's second model chunk (.0 its first). "
                     f"Model chunks held: {held}")
    return lines


def format_timeline(schedule: Schedule, timeline: Timeline | None = None) -> str:
    """One time-aligned line per pipeline rank, then the legend."""
    timeline = timeline or simulate(schedule)
    # Default costs are multiples of 1/v (see simulate.default_costs): scaling by v makes every
    # start and end a whole column; round() only absorbs float error.
    v = schedule.virtual_stages
    columns = round(timeline.makespan * v)
    width = 1 + max((len(action_label(schedule, r, a)) for r, rank in enumerate(timeline.ranks)
                     for a, _, _ in rank), default=2)
    prefix = max(len(f"Stage {r}: ") for r in range(schedule.stages))
    lines = []
    for r, rank in enumerate(timeline.ranks):
        cells = [" " * width] * columns
        for action, start, end in rank:
            first, last = round(start * v), round(end * v)
            span = width * (last - first)
            # The label, drawn on with dashes to the end of the action, then one space: so a
            # long action never runs into the next label and never reads as idle.
            cells[first] = action_label(schedule, r, action).ljust(span - 1, "-") + " "
            for column in range(first + 1, last):
                cells[column] = ""
        lines.append((f"Stage {r}: ".ljust(prefix) + "".join(cells)).rstrip())
    return "\n".join(lines + legend(schedule))


def draw_timeline(schedule: Schedule, path, timeline: Timeline | None = None) -> Path:
    """A Gantt chart PNG: one row per pipeline rank (rank 0 on top), F/B/W in their own colours,
    each box labelled with its microbatch (and chunk when a rank holds several)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    timeline = timeline or simulate(schedule)
    p = schedule.stages
    fig, ax = plt.subplots(figsize=(min(4 + timeline.makespan * 0.45, 40), 1 + 0.55 * p))
    for r, rank in enumerate(timeline.ranks):
        for action, start, end in rank:
            ax.barh(r, end - start, left=start, height=0.8, color=_COLOURS[action.op], edgecolor="white")
            ax.text((start + end) / 2, r, action_label(schedule, r, action)[1:], ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks(range(p), [f"Stage {r}" for r in range(p)])
    ax.invert_yaxis()  # rank 0 on top, as in the text timeline
    ax.set_xlim(0, timeline.makespan)
    ax.set_xlabel("time (one unit = one microbatch's forward through a whole stage)")
    names = {"F": "forward", "B": "backward", "W": "weight-gradient backward (W)"}
    if schedule.split_backward:
        names["B"] = "input-gradient backward (B)"
    ax.legend(handles=[Patch(color=_COLOURS[op], label=name) for op, name in names.items()
                       if op != "W" or schedule.split_backward],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if p < 4 else -0.2), ncol=3, fontsize=8)
    chunks = f", {schedule.virtual_stages} chunks per stage" if schedule.virtual_stages > 1 else ""
    ax.set_title(f"{schedule.name}: {p} stages, {schedule.microbatches} microbatches{chunks}; "
                 f"bubble {timeline.bubble:.1%}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path

"""`paratrain frontend trace --png FILE`: the instruction log as a picture, one lane per worker,
one bar per instruction (coloured by operation, as long as it ran), and a tick where the
dispatcher sent the worker a message (above the lane) or heard from it (below).

matplotlib draws it without pyplot (a Figure with the Agg canvas): no global figure state,
no display needed.
"""

from __future__ import annotations

from collections import defaultdict

from paratrain.frontend.trace import Event

COLOURED = 11  # operations with a colour of their own (by time spent); the rest are "other"


def draw_timeline(events: list[Event], out_path: str, width: float = 16.0, dpi: int = 120) -> int:
    """Write the timeline of `events` to `out_path` (PNG); -> how many instructions it shows."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ops = [e for e in events if e.event == "OP" and e.worker is not None]
    messages = [e for e in events if e.event in ("WORKER_SEND", "WORKER_RECV") and e.worker is not None]
    workers = sorted({e.worker for e in ops + messages})
    figure = Figure(figsize=(width, 1.5 + 0.9 * max(1, len(workers))), dpi=dpi)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    if not workers:
        axes.text(0.5, 0.5, "no instructions in this log", ha="center", va="center", transform=axes.transAxes)
        axes.set_axis_off()
        figure.savefig(out_path, format="png")
        return 0

    start = min(e.elapsed for e in ops + messages)
    colours = _colours(ops)
    lanes = {worker: lane for lane, worker in enumerate(workers)}
    bars = defaultdict(list)  # (lane, colour) -> [(start, length)]
    for e in ops:
        bars[lanes[e.worker], colours.get(e.op, "#7f7f7f")].append(
            (e.elapsed - start, float(e.details.get("dur_ms", 0.0)) / 1e3))
    for (lane, colour), spans in bars.items():
        axes.broken_barh(spans, (lane - 0.35, 0.7), facecolors=colour, linewidth=0)
    for kind, marker, offset in (("WORKER_SEND", "v", -0.45), ("WORKER_RECV", "^", 0.45)):  # y grows downwards
        ticks = [e for e in messages if e.event == kind]
        axes.scatter([e.elapsed - start for e in ticks], [lanes[e.worker] + offset for e in ticks],
                     marker=marker, s=12, color="black", label=f"{kind} (a message)")
    axes.set_yticks(range(len(workers)), [f"worker {w}" for w in workers])
    axes.set_ylim(-0.8, len(workers) - 0.2)
    axes.invert_yaxis()
    axes.set_xlabel("seconds since the first event")
    axes.set_title(f"{len(ops)} instructions on {len(workers)} worker(s)")
    handles = [Patch(color=colour, label=op) for op, colour in colours.items()]
    if len(colours) < len({e.op for e in ops}):
        handles.append(Patch(color="#7f7f7f", label="other"))
    axes.legend(handles=handles + axes.get_legend_handles_labels()[0], loc="upper left", bbox_to_anchor=(1.0, 1.0),
                fontsize="small")
    figure.tight_layout()
    figure.savefig(out_path, format="png")
    return len(ops)


def _colours(ops: list[Event]) -> dict[str, str]:
    """The operations that took the most time, a colour each (gray is left for "other")."""
    spent = defaultdict(float)
    for e in ops:
        spent[e.op] += float(e.details.get("dur_ms", 0.0))
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
               "#aec7e8", "#ffbb78"][:COLOURED]
    leaders = sorted(spent, key=lambda op: (-spent[op], op))[:len(palette)]
    return dict(zip(leaders, palette))

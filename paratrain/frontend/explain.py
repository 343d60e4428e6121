"""`paratrain frontend explain CONFIG`: what a signal configuration does, in words and a drawing.

Stages are the `pp_stage<k>` signals when there are any (the demo's convention), otherwise the
distinct sets of workers, in order of their first worker; each row of the drawing is a stage,
each column a tensor-parallel rank.
"""

from __future__ import annotations

import re

from paratrain.frontend.signals import Signal


def describe(signals: dict[str, Signal]) -> list[str]:
    width = max(len(name) for name in signals)
    lines = [f"{'signal':<{width}}  {'workers':<24}  layout", f"{'-' * width}  {'-' * 24}  {'-' * 30}"]
    for name, signal in signals.items():
        workers = ", ".join(map(str, signal.workers))
        if not signal.places:
            layout = "places nothing (runs where its inputs live)"
        elif signal.axis is None or len(signal.workers) == 1:
            layout = "replicated" if len(signal.workers) > 1 else "on one worker"
        else:
            layout = f"split along axis {signal.axis}, {len(signal.workers)} parts"
        backward = signals.get(signal.backward) if signal.backward else None
        if backward is not None and backward.places and backward.workers != signal.workers:
            layout += f"; backward on [{', '.join(map(str, backward.workers))}] ({signal.backward})"
        elif signal.backward:
            layout += f"; gradients back as {signal.backward}"
        if signal.compile:
            layout += "; compiled"
        lines.append(f"{name:<{width}}  [{workers}]{'':<{22 - len(workers)}}  {layout}")
    return lines


def draw(signals: dict[str, Signal]) -> list[str]:
    stages = _stages({name: signal for name, signal in signals.items() if signal.places})
    if not stages:
        return []
    tp = max(len(workers) for _, workers in stages)
    lines = ["", f"{'':<10}" + "".join(f"{'tp ' + str(r):>8}" for r in range(tp))]
    for index, (name, workers) in enumerate(stages):
        cells = "".join(f"{'w' + str(w):>8}" for w in workers)
        members = sorted(s for s, signal in signals.items() if set(signal.workers) == set(workers))
        lines.append(f"{'stage ' + str(index):<10}{cells}{'':<{8 * (tp - len(workers)) + 4}}{', '.join(members)}")
    pipeline = len(stages)
    lines.append("")
    lines.append(f"{pipeline} pipeline stage(s) x {tp}-way tensor parallelism = {pipeline * tp} workers"
                 if pipeline * tp == len({w for _, ws in stages for w in ws}) else f"{pipeline} worker groups")
    return lines


def _stages(signals: dict[str, Signal]) -> list[tuple[str, tuple[int, ...]]]:
    named = {int(m.group(1)): signal for name, signal in signals.items() if (m := re.fullmatch(r"pp_stage(\d+)", name))}
    if named:
        return [(f"pp_stage{k}", named[k].workers) for k in sorted(named)]
    seen, stages = set(), []
    for name, signal in sorted(signals.items(), key=lambda item: min(item[1].workers)):
        if signal.workers not in seen:
            seen.add(signal.workers)
            stages.append((name, signal.workers))
    return stages

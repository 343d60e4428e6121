"""Play a schedule forward in time without a model: when each action starts and ends, how long
each rank sits idle (the bubble), and how many activations each rank holds at worst.

Communication is free here (zero latency); this is the schedule's own shape, not a prediction
of a particular machine. The planner passes measured `costs` to get closer to one.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.parallel.pipeline.schedules import Action, Schedule, build_schedule, dependencies


class ScheduleDeadlock(RuntimeError):
    """The per-rank lists cannot all complete: every unfinished rank waits on an action that
    can never run before it."""


@dataclass(frozen=True)
class Timeline:
    schedule: Schedule
    ranks: tuple[tuple[tuple[Action, float, float], ...], ...]  # ranks[r] = (action, start, end), in order
    makespan: float            # time from the first start to the last end
    bubble: float              # idle share of all ranks' time: 1 - busy / (p * makespan)
    peak_in_flight: tuple[int, ...]  # per rank: most (microbatch, chunk) pairs between F and last backward


def default_costs(schedule: Schedule) -> dict[str, float]:
    """Unit costs per chunk action, scaled by 1/v so one whole microbatch (F + B [+ W] through
    every chunk of a rank) costs 3 in every schedule, and bubbles compare across schedules.
    The backward costs twice the forward, as it does for most layers; split, each half costs one."""
    v = schedule.virtual_stages
    if schedule.split_backward:
        return {"F": 1 / v, "B": 1 / v, "W": 1 / v}
    return {"F": 1 / v, "B": 2 / v}


def simulate(schedule: Schedule, costs: dict[str, float] | None = None) -> Timeline:
    """Run every rank's list in order, each action starting as soon as its rank is free and its
    dependencies have ended. `costs` maps op ("F", "B", "W") to the duration of one chunk action,
    or to a sequence of durations indexed by chunk (the planner's chunks differ: embedding, head)."""
    costs = costs or default_costs(schedule)
    p = schedule.stages
    ended: dict[Action, float] = {}
    position = [0] * p           # index of each rank's next action
    free_at = [0.0] * p
    timeline = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(schedule.ranks):
            # Run this rank as far as it can go; a dependency not yet ended stops it until
            # another rank's turn ends it (or nobody can, which is the deadlock below).
            while position[r] < len(order):
                action = order[position[r]]
                deps = dependencies(action, schedule.num_chunks)
                if any(d not in ended for d in deps):
                    break
                start = max([free_at[r]] + [ended[d] for d in deps])
                cost = costs[action.op]
                end = start + (cost if isinstance(cost, (int, float)) else cost[action.stage])
                ended[action] = free_at[r] = end
                timeline[r].append((action, start, end))
                position[r] += 1
                progress = True
    stuck = [r for r in range(p) if position[r] < len(schedule.ranks[r])]
    if stuck:
        waits = "; ".join(f"rank {r} at action {position[r]} ({_describe(schedule.ranks[r][position[r]])})"
                          for r in stuck)
        raise ScheduleDeadlock(f"{schedule.name} schedule deadlocks: {waits}")
    makespan = max(free_at, default=0.0)
    busy = sum(end - start for rank in timeline for _, start, end in rank)
    bubble = 1 - busy / (p * makespan) if makespan else 0.0
    return Timeline(schedule, tuple(tuple(rank) for rank in timeline), makespan, bubble,
                    tuple(_peak_in_flight(order, schedule.last_backward_op) for order in schedule.ranks))


def _describe(action: Action) -> str:
    return f"{action.op}{action.microbatch} on chunk {action.stage}"


def _peak_in_flight(order: tuple[Action, ...], last_backward_op: str) -> int:
    held = peak = 0
    for action in order:
        if action.op == "F":
            held += 1
            peak = max(peak, held)
        elif action.op == last_backward_op:
            held -= 1
    return peak


def theoretical_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction with backward = 2 x forward: (p-1)/(m+p-1) for gpipe and 1f1b
    (GPipe; Narayanan et al. 2021), (p-1)/(v*m+p-1) for interleaved-1f1b (each bubble slot is 1/v
    as long), (p-1)/(6m+p-1) for zb-v: each rank computes 2 half-size chunks x m microbatches x
    (F + B + W = 3 halves) = 3m, and idles only while the first forward reaches the last rank,
    (p-1) half-size forwards = (p-1)/2. zb-h1 has no closed form that holds at every size, so for
    it this returns the simulated bubble (unit costs) of the schedule `build_schedule` makes."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-v":
        return (p - 1) / (6 * m + p - 1)
    return simulate(build_schedule(name, p, m, v)).bubble

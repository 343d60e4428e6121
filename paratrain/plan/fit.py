"""Fit a cost model's parameters to measurements, and write them as a hardware profile.

Collectives: `bench collectives --json` records, grouped by (launcher, world size, op,
algorithm), each group fitted to time = alpha + bytes / bandwidth by least squares on the
relative error (so a 1 KiB message counts as much as a 16 MiB one). Point-to-point: the
unidirectional records of `bench p2p --json`, the median over pairs at each size, fitted the
same way. The profile keeps, per (op, world size), the algorithm training uses by default
('auto', else 'native', else 'ring'); the others are written as comments for comparison.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paratrain.plan.hardware import Fitted, HardwareProfile, profile_to_dict

PREFERRED_ALGOS = ("auto", "native", "ring")  # what training runs with when nobody says
FITTED_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


@dataclass(frozen=True)
class Fit:
    key: tuple  # (launcher, world_size, op, algo)
    fitted: Fitted
    points: int
    rms_error: float  # root-mean-square relative error of the fit over its points
    source: str


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[Fitted, float]:
    """(Fitted, rms relative error of the line) for (bytes, seconds) points; alpha and
    1/bandwidth >= 0. The Fitted keeps the median time at each size too."""
    sizes = np.array([p[0] for p in points], dtype=float)
    seconds = np.array([p[1] for p in points], dtype=float)
    a = np.stack([np.ones_like(sizes), sizes], axis=1) / seconds[:, None]
    (alpha, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(seconds), rcond=None)
    if per_byte <= 0:  # latency-bound throughout: bandwidth beyond what was measured
        per_byte = 1e-15
        alpha = float(np.mean(seconds - sizes * per_byte))
    if alpha < 0:  # bandwidth-bound throughout: refit with no latency
        alpha, per_byte = 0.0, float(np.sum(sizes / seconds) / np.sum((sizes / seconds) ** 2))
    line = Fitted(alpha_us=round(float(alpha) * 1e6, 3), gbps=round(1 / float(per_byte) / 1e9, 6))
    errors = [line.seconds(s) / t - 1 for s, t in zip(sizes, seconds)]
    by_size = defaultdict(list)
    for size, t in zip(sizes, seconds):
        by_size[float(size)].append(t)
    medians = tuple((size, round(statistics.median(ts) * 1e6, 2)) for size, ts in sorted(by_size.items()))
    return Fitted(line.alpha_us, line.gbps, medians), float(np.sqrt(np.mean(np.square(errors))))


def load_records(paths: list[Path]) -> list[tuple[dict, str]]:
    """(record, file name) for every record of every file."""
    found = []
    for path in paths:
        try:
            records = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read {path}: {error}") from None
        if not isinstance(records, list):
            raise ValueError(f"{path}: expected a JSON list of records (bench collectives/p2p --json)")
        found += [(record, Path(path).name) for record in records]
    return found


def fit_records(records: list[tuple[dict, str]]) -> list[Fit]:
    groups: dict[tuple, list] = defaultdict(list)
    sources: dict[tuple, set] = defaultdict(set)
    by_size: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record, source in records:
        if record.get("op") in FITTED_OPS and record.get("bytes") and record.get("time_us") and not record.get("wrong"):
            algo = "auto" if record["algo"].startswith("auto") else record["algo"]  # "auto(ring)": auto's pick
            key = (record.get("launcher", "?"), record["world_size"], record["op"], algo)
            groups[key].append((record["bytes"], record["time_us"] * 1e-6))
            sources[key].add(source)
        elif record.get("test") == "uni" and record.get("bytes") and record.get("time_us"):
            key = (record.get("launcher", "?"), 2, "p2p", record.get("transport", "?"))
            # A round is the message plus a 1-byte ack: half the smallest round is the ack's.
            by_size[key][record["bytes"]].append(record["time_us"] * 1e-6)
            sources[key].add(source)
    for key, sizes in by_size.items():
        ack = statistics.median(sizes[min(sizes)]) / 2
        groups[key] = [(size, max(statistics.median(times) - ack, 1e-9)) for size, times in sizes.items()]
    fits = []
    for key, points in sorted(groups.items(), key=lambda item: tuple(map(str, item[0]))):
        if len({size for size, _ in points}) < 2:
            continue  # one size cannot separate latency from bandwidth
        fitted, error = fit_alpha_beta(points)
        fits.append(Fit(key, fitted, len(points), error, ", ".join(sorted(sources[key]))))
    return fits


def chosen_fits(fits: list[Fit]) -> dict[str, Fit]:
    """Per 'op/world_size', the fit of the algorithm training would use."""
    chosen: dict[str, Fit] = {}
    for fit in fits:
        launcher, world, op, algo = fit.key
        name = f"{op}/{world}"
        rank = PREFERRED_ALGOS.index(algo) if algo in PREFERRED_ALGOS else len(PREFERRED_ALGOS)
        current = chosen.get(name)
        if current is None or rank < (PREFERRED_ALGOS.index(current.key[3]) if current.key[3] in PREFERRED_ALGOS
                                      else len(PREFERRED_ALGOS)):
            chosen[name] = fit
    return chosen


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def profile_yaml(profile: HardwareProfile, comments: dict[str, str], header: list[str],
                 fits: list[Fit] = (), chosen: dict[str, Fit] | None = None) -> str:
    """The profile as YAML in the shipped files' layout, a `# source` comment on each value."""
    raw = profile_to_dict(profile)
    lines = [f"# {line}" for line in header]
    for key, value in raw.items():
        if key == "collectives":
            continue
        if isinstance(value, dict):
            lines.append(f"{key}:")
            for sub, subvalue in value.items():
                lines.append(f"  {sub}: {_scalar(subvalue)}  # {comments.get(f'{key}.{sub}', 'from the base profile')}")
        else:
            lines.append(f"{key}: {_scalar(value)}  # {comments.get(key, 'from the base profile')}")
    lines.append("collectives:  # measured: time = alpha + bytes / bandwidth per op and world size")
    chosen = chosen or {}
    for name, fitted in raw["collectives"].items():
        fit = chosen.get(name)
        note = (f"{fit.key[3]} over {fit.key[0]}, {fit.points} sizes, rms error {fit.rms_error:.0%}, from {fit.source}"
                if fit else "from the base profile")
        points = ", ".join(f"[{int(size)}, {us}]" for size, us in fitted["points"])
        lines.append(f"  {name}: {{alpha_us: {fitted['alpha_us']}, gbps: {fitted['gbps']}, points: [{points}]}}  # {note}")
    for fit in fits:
        if chosen.get(f"{fit.key[2]}/{fit.key[1]}") is not fit:
            lines.append(f"  # not used: {fit.key[2]}/{fit.key[1]} {fit.key[3]} over {fit.key[0]}: alpha "
                         f"{fit.fitted.alpha_us} us, {fit.fitted.gbps} GB/s (rms error {fit.rms_error:.0%})")
    return "\n".join(lines) + "\n"

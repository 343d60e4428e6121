"""How `bench collectives --tune` turns measurements into the algorithm table `auto` reads.

The backend's own collective is the default, and another algorithm replaces it only when the
measurements say so beyond doubt. A sweep runs the algorithms in interleaved bursts, so round i
of every algorithm saw the same moment of the machine; the challenger's time over native's,
round by round, cancels most of what a busy machine does to both. The challenger wins when the
median of those ratios is below 1 by more than the noise (half their interquartile range, at
least MIN_MARGIN) and it was faster in at least 3 of every 4 rounds. Picking by a bare minimum,
as before, let noise choose: `auto` came out slower than native at some sizes on a shared
2-core machine.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from paratrain.bench.collectives import Measurement

# Below this a gain is not worth leaving the backend's path, and on a shared machine it is
# not reliably measurable anyway.
MIN_MARGIN = 0.03
WIN_SHARE = 0.75  # the share of paired rounds a challenger must win


@dataclass(frozen=True)
class Verdict:
    algo: str
    why: str  # one line for --explain


def noise(ratios: list[float]) -> float:
    """Half the interquartile range of the per-round ratios."""
    if len(ratios) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return (q3 - q1) / 2


def judge(native: Measurement, challengers: list[Measurement]) -> Verdict:
    """Native, unless a challenger is faster by more than the noise and wins most rounds."""
    if not challengers:
        return Verdict("native", "native: nothing else was measured")
    best, detail = None, []
    for challenger in challengers:
        ratios = [c / n for c, n in zip(challenger.bursts_us, native.bursts_us)]
        if not ratios:  # no rounds recorded: the medians are all there is
            ratios = [challenger.time_us / native.time_us]
        ratio = statistics.median(ratios)
        wins = sum(r < 1 for r in ratios)
        margin = max(MIN_MARGIN, noise(ratios))
        detail.append((challenger.algo, ratio, wins, len(ratios), margin))
        if ratio < 1 - margin and wins >= WIN_SHARE * len(ratios) and (best is None or ratio < best[1]):
            best = detail[-1]
    if best is not None:
        algo, ratio, wins, rounds, margin = best
        return Verdict(algo, f"{algo} took {ratio:.2f}x native's time, faster in {wins}/{rounds} rounds"
                             f" (noise +-{margin:.0%})")
    algo, ratio, wins, rounds, margin = min(detail, key=lambda d: d[1])  # the closest, still not enough
    if ratio >= 1:
        return Verdict("native", f"native fastest: the best other, {algo}, took {ratio:.2f}x its time")
    return Verdict("native", f"native kept: {algo} took {ratio:.2f}x its time, faster in {wins}/{rounds}"
                             f" rounds, within the noise (+-{margin:.0%})")


def tuned_choices(measurements: list[Measurement]) -> dict[tuple[str, int], Verdict]:
    """(op, bytes) -> what `auto` should run there. Auto's own rows and wrong results take no
    part; without a native row the fastest median wins."""
    by_case: dict[tuple[str, int], list[Measurement]] = {}
    for m in measurements:
        if m.algo != "auto" and not m.wrong:
            by_case.setdefault((m.op, m.bytes), []).append(m)
    verdicts = {}
    for key, rows in by_case.items():
        native = next((m for m in rows if m.algo == "native"), None)
        if native is None:
            fastest = min(rows, key=lambda m: m.time_us)
            verdicts[key] = Verdict(fastest.algo, f"fastest of {', '.join(m.algo for m in rows)} (native not measured)")
        else:
            verdicts[key] = judge(native, [m for m in rows if m is not native])
    return verdicts

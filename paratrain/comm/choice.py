"""How `algo="auto"` picks an algorithm: from a table measured on this machine, else defaults.

`paratrain bench collectives --tune` measures every algorithm and records, per (transport,
world size, op, message size), the one to run there: the backend's own unless another was
faster beyond the measured noise (see bench/tuning.py), with a line saying why. Lookups use the
nearest measured size (in log scale) for the nearest measured world size. Without a table the
defaults below apply; each says why it is what it is, and `--explain` prints those reasons.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

KIB, MIB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Choice:
    algo: str
    reason: str


def default_table_path() -> Path:
    """$PARATRAIN_ALGO_TABLE, else the user's cache directory."""
    override = os.environ.get("PARATRAIN_ALGO_TABLE")
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "paratrain" / "algorithms.json"


def default_choice(op: str, nbytes: int, world_size: int, transport: str) -> Choice:
    """The choice when nothing was measured."""
    if world_size == 1:
        return Choice("native", "one rank: nothing to communicate")
    if transport == "nccl":
        return Choice("native", "NCCL's own kernels pick ring or tree on the GPU itself")
    if transport == "shm":
        return _on_shared_memory(op, nbytes)
    if transport == "gloo":
        if op == "reduce_scatter" and nbytes >= 256 * KIB:
            return Choice(
                "ring",
                "gloo's reduce_scatter is a full all-reduce plus a copy; the ring moves half the bytes",
            )
        return Choice("native", "not measured here: gloo's own, the safe default; --tune measures whether"
                                " ring or hd beat it on this machine")
    # The fabric: its native collectives are shared-memory reads, one pass over the inputs.
    if op in ("broadcast", "reduce", "all_to_all", "barrier") or nbytes < 64 * KIB:
        return Choice("native", "shared memory: every rank reads the inputs directly, no messages")
    return Choice("ring", "large message: the ring spreads the reduction over all ranks' threads")


# Measured with `paratrain bench collectives` on 2 and 4 processes of one 2-core host (all-reduce
# also on 3): the picks below beat gloo's own at every op and size from 16 KiB to 64 MiB there
# (1.5x to 13x), since gloo's moves each message through a socket and wakes threads at both
# ends. Not every algorithm did: the ring broadcast took 1.4x gloo's time at 256 KiB on 4.
_SHM_WHY = "on one host through shared memory (transport/shm.py) this beat gloo's own at every size measured"


def _on_shared_memory(op: str, nbytes: int) -> Choice:
    """The defaults for a process group whose ranks all share one host ("shm", TorchTransport.wire)."""
    if op in ("reduce_scatter", "reduce", "all_to_all", "barrier"):
        return Choice("direct", f"{_SHM_WHY}; direct: one round of messages, straight to where each part goes")
    if op == "broadcast":
        if nbytes < 16 * MIB:
            return Choice("direct", f"{_SHM_WHY}; direct: the root writes to every rank at once")
        return Choice("tree", f"{_SHM_WHY}; tree: large messages, forwarded down a binomial tree by all ranks")
    if op == "all_gather":
        if nbytes < 64 * KIB:
            return Choice("hd", f"{_SHM_WHY}; hd: small messages, log2(n) rounds")
        if nbytes < 16 * MIB:
            return Choice("direct", f"{_SHM_WHY}; direct: one round, each rank to every other")
        return Choice("ring", f"{_SHM_WHY}; ring: large messages, every rank sends and receives at once")
    if nbytes < MIB:  # all_reduce
        return Choice("direct", f"{_SHM_WHY}; direct: two rounds (everything to rank 0, then back), the fewest")
    if nbytes < 8 * MIB:
        return Choice("hd", f"{_SHM_WHY}; hd: 2 log2(n) rounds, halving the message each time")
    return Choice("ring", f"{_SHM_WHY}; ring: large messages, every rank sends and receives at once")


class AlgorithmTable:
    def __init__(self, measured: dict | None = None, path: Path | None = None, why: dict | None = None):
        # measured[transport][world_size][op] = {bytes: algo}; keys are strings in the file.
        self.measured: dict[str, dict[str, dict[str, dict[str, str]]]] = measured or {}
        self.why: dict[str, dict[str, dict[str, dict[str, str]]]] = why or {}  # same keys: the reason
        self.path = path
        # choose()'s answers so far: a training loop asks about the same few sizes every step,
        # and each lookup costs microseconds of every call. record() forgets them.
        self._chosen: dict[tuple, Choice] = {}

    @classmethod
    def load(cls, path: Path | str | None = None) -> AlgorithmTable:
        path = Path(path) if path is not None else default_table_path()
        if not path.exists():
            return cls({}, path)
        try:
            data = json.loads(path.read_text())
            measured, why = data["measured"], data.get("why", {})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(
                f"algorithm table {path} is unreadable ({error}); delete it or re-run "
                "`paratrain bench collectives --tune`"
            ) from None
        return cls(measured, path, why)

    def save(self, path: Path | str | None = None) -> Path:
        target = Path(path) if path is not None else (self.path or default_table_path())
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        record = {"version": 1, "measured": self.measured, "why": self.why}
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        tmp.replace(target)  # never leave a half-written table behind
        return target

    def record(self, transport: str, world_size: int, op: str, nbytes: int, algo: str,
               why: str | None = None) -> None:
        sizes = self.measured.setdefault(transport, {}).setdefault(str(world_size), {})
        sizes.setdefault(op, {})[str(nbytes)] = algo
        reasons = self.why.setdefault(transport, {}).setdefault(str(world_size), {}).setdefault(op, {})
        if why:
            reasons[str(nbytes)] = why
        else:
            reasons.pop(str(nbytes), None)
        self._chosen.clear()

    def choose(self, op: str, nbytes: int, world_size: int, transport: str) -> Choice:
        key = (op, nbytes, world_size, transport)
        choice = self._chosen.get(key)
        if choice is None:
            choice = self._chosen[key] = self._look_up(op, nbytes, world_size, transport)
        return choice

    def _look_up(self, op: str, nbytes: int, world_size: int, transport: str) -> Choice:
        by_world = self.measured.get(transport, {})
        candidates = [int(w) for w, ops in by_world.items() if op in ops]
        if not candidates or world_size == 1:
            return default_choice(op, nbytes, world_size, transport)
        world = min(candidates, key=lambda w: (abs(w - world_size), w))
        sizes = by_world[str(world)][op]
        nearest = min(sizes, key=lambda s: abs(math.log2(max(int(s), 1)) - math.log2(max(nbytes, 1))))
        algo = sizes[nearest]
        where = f"{transport} x{world}" + ("" if world == world_size else f" (nearest to x{world_size})")
        why = self.why.get(transport, {}).get(str(world), {}).get(op, {}).get(nearest)
        if why is None:  # a table written before reasons were kept, or by hand
            return Choice(algo, f"fastest when measured at {_human(int(nearest))} on {where}")
        return Choice(algo, f"{why}; measured at {_human(int(nearest))} on {where}")


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"

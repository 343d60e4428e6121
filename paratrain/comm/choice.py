"""How `algo="auto"` picks an algorithm: from a table measured on this machine, else defaults.

`paratrain bench collectives --tune` measures every algorithm and records, per (transport,
world size, op, message size), the one to run there: the backend's own unless another was
faster beyond the measured noise (see bench/tuning.py), with a line saying why, and the host it
was measured on. Lookups use the nearest measured size (in log scale) for the nearest measured
world size. Without a table the defaults below apply; each says why it is what it is, and
`--explain` prints those reasons.

Which table a world uses (`AlgorithmTable.in_use`): one named (PARATRAIN_ALGO_TABLE, or a
command's --table) always; the cached one (~/.cache/paratrain/algorithms.json) only where it was
written on this host for this world size, so that `auto` does not quietly differ from user to
user or machine to machine. `status` says which, and `--explain` and `paratrain env` print it.
"""

from __future__ import annotations

import json
import math
import socket
from dataclasses import dataclass
from pathlib import Path

KIB, MIB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Choice:
    algo: str
    reason: str


def default_choice(op: str, nbytes: int, world_size: int, transport: str) -> Choice:
    """The choice when nothing was measured."""
    if world_size == 1:
        return Choice("native", "one rank: nothing to communicate")
    if transport == "nccl":
        return Choice("native", "NCCL's own kernels pick ring or tree on the GPU itself")
    if transport == "shm":
        return _on_shared_memory(op, nbytes, world_size)
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


def uneven_all_to_all_choice(world_size: int, transport: str) -> Choice:
    """`auto` for an all_to_all with split sizes. Its ranks pass buffers of different sizes, and
    a pick by size (a measured table's) could differ from rank to rank, which would leave them
    waiting on each other's different calls; so the transport's default, which takes no size."""
    choice = default_choice("all_to_all", 0, world_size, transport)
    return Choice(choice.algo, f"{choice.reason}; split sizes differ from rank to rank, so picked by transport alone")


# Across hosts: the ops with a hierarchical algorithm (algorithms/hierarchical.py), and the
# message size from which it is `auto`'s pick (below it, the steps' latency outweighs the bytes).
HIER_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
HIER_LEAST_BYTES = 64 * KIB
# The most ranks whose barrier across hosts is `direct`: n-1 messages from each rank, where
# gloo's own takes log2(n) rounds (beyond, a lost rank goes unnamed rather than the barrier slow).
DIRECT_BARRIER_MOST_RANKS = 64


def across_hosts_choice(op: str, nbytes: int | None, hosts: int, per_host: int) -> Choice | None:
    """`auto` for a group whose ranks span `hosts` hosts, `per_host` on each: the hierarchical
    algorithm, or None for the flat one (the table's). `nbytes` None: an uneven all_to_all,
    picked without its size (see uneven_all_to_all_choice)."""
    if op == "barrier" and hosts * per_host <= DIRECT_BARRIER_MOST_RANKS:
        # gloo's own barrier fails without saying which peer it lost; across hosts, where a rank
        # loses a whole machine's ranks at once, the survivors should name them (and their host).
        return Choice("direct", f"the group spans {hosts} hosts: each rank hears from every other, so a rank "
                                "lost in the barrier is named, where gloo's own barrier does not say which")
    if op not in HIER_OPS or per_host < 2:
        return None
    if nbytes is not None and nbytes < HIER_LEAST_BYTES:
        return None
    return Choice("hier", f"the group spans {hosts} hosts of {per_host} ranks: hier works inside each host "
                          f"through shared memory and sends 1/{per_host} of the data across")


# On one host (`paratrain bench collectives --peer mpi`, docs/results.md): through the group's
# shared segment every op beats the same op as messages through the rings (transport/shm.py),
# which in turn beat gloo's own, because a copy into shared memory is all a message costs there.
_SHM_WHY = "on one host every rank reads its peers' copies in the shared segment, no messages"


def _on_shared_memory(op: str, nbytes: int, world_size: int) -> Choice:
    """The defaults for the shared-memory transport: a process group whose ranks all share one host
    (kind "shm", transport/shm_transport.py)."""
    if op == "barrier":
        return Choice("oneshot", f"{_SHM_WHY}; oneshot: a step in the segment is the barrier itself")
    if op != "all_reduce":
        return Choice("oneshot", f"{_SHM_WHY}; oneshot: one copy in, one step, one pass over the copies")
    if world_size == 2:
        return Choice("oneshot", f"{_SHM_WHY}; oneshot: with 2 ranks each adds its peer's copy to its own "
                                 "buffer, as few bytes moved as twoshot and one step instead of two")
    if nbytes < 256 * KIB:
        return Choice("oneshot", f"{_SHM_WHY}; oneshot: small message, every rank reduces it all after one step")
    return Choice("twoshot", f"{_SHM_WHY}; twoshot: large message, each rank reduces 1/n of it, then all copy")


class AlgorithmTable:
    def __init__(self, measured: dict | None = None, path: Path | None = None, why: dict | None = None,
                 host: str | None = None, status: str = "no table: the defaults"):
        # measured[transport][world_size][op] = {bytes: algo}; keys are strings in the file.
        self.measured: dict[str, dict[str, dict[str, dict[str, str]]]] = measured or {}
        self.why: dict[str, dict[str, dict[str, dict[str, str]]]] = why or {}  # same keys: the reason
        self.path = path
        self.host = host  # where it was measured (None: a table written before hosts were kept)
        self.status = status  # whether and why it is in use, in words
        # choose()'s answers so far: a training loop asks about the same few sizes every step,
        # and each lookup costs microseconds of every call. record() forgets them, and counts
        # up `version`, so that what others remembered of an answer can be checked in one compare.
        self._chosen: dict[tuple, Choice] = {}
        self.version = 0

    @classmethod
    def load(cls, path: Path | str) -> AlgorithmTable:
        path = Path(path)
        if not path.exists():
            return cls({}, path, status="none there: the defaults")
        try:
            data = json.loads(path.read_text())
            measured, why, host = data["measured"], data.get("why", {}), data.get("host")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(
                f"algorithm table {path} is unreadable ({error}); delete it or re-run "
                "`paratrain bench collectives --tune`"
            ) from None
        return cls(measured, path, why, host, status="in use")

    @classmethod
    def in_use(cls, path: Path | str, named: bool, world_size: int) -> AlgorithmTable:
        """The table `auto` consults in a world of `world_size` ranks: the one at `path` if it was
        `named` (by a flag or PARATRAIN_ALGO_TABLE) or written on this host for this world size;
        else none (the defaults). Its `status` says which."""
        table = cls.load(path)
        if not table.measured:
            return table
        if named:
            table.status = "in use (named)"
            return table
        here, worlds = this_host(), table.world_sizes()
        if table.host != here:
            written = f"on {table.host}" if table.host else "on an unrecorded host"
            return cls({}, table.path, status=f"not in use, the defaults: written {written}, not on {here} "
                                              "(name it with PARATRAIN_ALGO_TABLE to use it)")
        if world_size not in worlds:
            return cls({}, table.path, status=f"not in use, the defaults: measured for world size "
                                              f"{', '.join(map(str, worlds))}, not {world_size}")
        table.status = f"in use (written on this host for world size {world_size})"
        return table

    def world_sizes(self) -> list[int]:
        return sorted({int(world) for by_world in self.measured.values() for world in by_world})

    def save(self, path: Path | str | None = None) -> Path:
        """Write the table (to `path`, else where it was read), recording this host as its own."""
        target = Path(path) if path is not None else self.path
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        self.host = this_host()
        record = {"version": 1, "host": self.host, "measured": self.measured, "why": self.why}
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
        self.version += 1

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


def this_host() -> str:
    return socket.gethostname()


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"

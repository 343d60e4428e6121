"""Reading the ranks' flight records after a hang: who is behind, which calls differ.

Ranks of a group make the same collective calls in the same order, so call #n of a group must
be the same call on every member. Comparing the members' records says:
- calls that differ: the same call number with another op, shape, dtype or algorithm;
- a rank that is behind: the others started call #n, it never did (its last call is older);
- a rank with no record: it never failed (it finished, or is stuck outside communication) or
  it was killed;
- point-to-point calls that never completed.

All ranks here are numbered in the world (the records store them so).
"""

from __future__ import annotations

from collections import defaultdict


def describe(call: dict) -> str:
    """A call as the debug check prints it: all_reduce(float32[4], op=sum) [algo=ring]."""
    text = call["op"]
    if call["dtype"] is not None:  # a barrier has no tensor
        text += f"({call['dtype']}{call['shape']}"
        text += f", op={call['reduce_op']}" if call.get("reduce_op") else ""
        text += f", root={call['root']}" if call.get("root") is not None else ""
        text += ")"
    if call["kind"] == "p2p":
        return f"{text} {'to' if call['op'] == 'send' else 'from'} rank {call['peer']}"
    return f"{text} [algo={call['algo']}]"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _state(call: dict) -> str:
    if call["finished"] is None:
        return "still running"
    return f"{call['state']} after {call['finished'] - call['started']:.3g}s"


class _Group:
    """One group's collective calls, by rank and call number."""

    def __init__(self, ranks: tuple[int, ...]):
        self.ranks = ranks
        self.calls: dict[int, dict[int, dict]] = defaultdict(dict)  # rank -> seq -> call

    def name(self) -> str:
        return f"group {list(self.ranks)}"

    def mismatch(self) -> str | None:
        """The first call number whose calls differ across ranks."""
        seqs = sorted({seq for calls in self.calls.values() for seq in calls})
        for seq in seqs:
            variants: dict[str, list[int]] = defaultdict(list)
            for rank, calls in sorted(self.calls.items()):
                if seq in calls:
                    variants[describe(calls[seq])].append(rank)
            if len(variants) > 1:
                parts = [f"{_ranks(ranks)} called {text}" for text, ranks in variants.items()]
                return f"call #{seq} differs in {self.name()}: " + "; ".join(parts)
        return None

    def last_calls(self, dumps: dict[int, dict]) -> dict[int, int]:
        """Each recorded member's last call number here (0: none). A member whose ring buffer
        is full of other groups' calls may have made calls here we cannot see: left out."""
        last = {}
        for rank in self.ranks:
            if rank not in dumps:
                continue
            if self.calls.get(rank):
                last[rank] = max(self.calls[rank])
            elif len(dumps[rank]["calls"]) < dumps[rank]["capacity"]:
                last[rank] = 0
        return last

    def behind(self, dumps: dict[int, dict]) -> list[str]:
        last = self.last_calls(dumps)
        if not last:
            return []
        lead = max(last.values())
        problems = []
        for rank in sorted(r for r in last if last[r] < lead):
            missed = last[rank] + 1
            starters = [r for r in last if missed in self.calls.get(r, {})]
            if starters:
                what = f"{describe(self.calls[starters[0]][missed])}, which {_ranks(starters)} started"
            else:  # the others' buffers no longer hold it
                what = f"while others are at call #{lead}"
            problems.append(f"rank {rank} is behind in {self.name()}: it never started call #{missed}, {what}")
        return problems

    def stalled(self, dumps: dict[int, dict]) -> str | None:
        """Every member at the same call, which failed somewhere or completed nowhere: no rank
        is behind, so the call itself (or the transport under it) went wrong. (Some members
        done and the rest still in it is a call finishing, as an on-request dump may catch.)"""
        last = self.last_calls(dumps)
        if len(last) < len(self.ranks) or len(set(last.values())) > 1 or not min(last.values()):
            return None
        seq = next(iter(last.values()))
        states = [self.calls[r][seq]["state"] for r in last]
        if "failed" not in states and "completed" in states:
            return None
        unfinished = [r for r in last if self.calls[r][seq]["state"] != "completed"]
        call = self.calls[unfinished[0]][seq]
        return (f"no rank is behind in {self.name()}, but call #{seq}, {describe(call)}, did not "
                f"complete on {_ranks(unfinished)}")

    def unrecorded(self, dumps: dict[int, dict]) -> str | None:
        missing = [r for r in self.ranks if r not in dumps]
        if not missing:
            return None
        unfinished = [
            f"rank {rank} {'failed in' if call['state'] == 'failed' else 'is still in'} call #{seq}"
            for rank, seq in sorted(self.last_calls(dumps).items())
            if seq and (call := self.calls[rank][seq])["state"] != "completed"
        ]
        text = (f"no flight record from {_ranks(missing)} of {self.name()} (it finished, was killed, "
                f"or is stuck outside communication)")
        return text + (f"; {', '.join(unfinished)}" if unfinished else "")

    def details(self, dumps: dict[int, dict]) -> list[str]:
        lines = [f"{self.name()}, collectives (last call of each rank):"]
        last = self.last_calls(dumps)
        for rank in self.ranks:
            if rank not in dumps:
                lines.append(f"  rank {rank}: no flight record")
            elif rank not in last:
                lines.append(f"  rank {rank}: its records hold no call of this group")
            elif last[rank] == 0:
                lines.append(f"  rank {rank}: no call yet")
            else:
                call = self.calls[rank][last[rank]]
                lines.append(f"  rank {rank}: call #{last[rank]} {describe(call)} {_state(call)}")
        return lines


def analyse(dumps: dict[int, dict]) -> tuple[list[str], list[str]]:
    """(problems, most telling first; details) from the ranks' flight records."""
    groups: dict[tuple, _Group] = {}
    pending_p2p = []
    for rank, dump in sorted(dumps.items()):
        for call in dump["calls"]:
            key = (tuple(call["group"]), call["group_index"])
            group = groups.setdefault(key, _Group(key[0]))
            if call["kind"] == "collective":
                group.calls[rank][call["seq"]] = call
            elif call["state"] != "completed":
                pending_p2p.append(
                    f"rank {rank} did not complete {describe(call)} "
                    f"(p2p call #{call['seq']} in {group.name()}): {_state(call)}"
                )
    problems, details = [], []
    mismatched = set()
    for key in sorted(groups):
        mismatch = groups[key].mismatch()
        if mismatch:
            problems.append(mismatch)
            mismatched.add(key)
    for key in sorted(groups):
        problems += groups[key].behind(dumps)
    for key in sorted(groups):
        problems += [p for p in [groups[key].unrecorded(dumps)] if p]
        if key not in mismatched:  # a mismatch is why its call did not complete
            problems += [p for p in [groups[key].stalled(dumps)] if p]
    problems += pending_p2p
    for key in sorted(groups):
        if groups[key].calls:
            details += groups[key].details(dumps)
    for rank, dump in sorted(dumps.items()):
        if dump.get("error"):
            details.append(f"rank {rank} failed: {dump['error'].splitlines()[0]}")
    return problems, details


def report(dumps: dict[int, dict], directory: str) -> tuple[list[str], bool]:
    """The lines `paratrain debug hang` prints, and whether they name a problem."""
    problems, details = analyse(dumps)
    head = problems[0] if problems else "no problem found: every rank is at the same call of every group"
    lines = [head, f"flight records of {_ranks(dumps)} in {directory} (ranks numbered in the world)"]
    lines += [f"also: {problem}" for problem in problems[1:]]
    return lines + details, bool(problems)

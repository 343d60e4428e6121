"""Pipeline schedules as data: `build_schedule(name, stages, microbatches)` returns, for every
pipeline rank, the ordered list of compute actions it runs. Nothing here touches a tensor.

Vocabulary. The model is cut into `num_chunks` consecutive chunks (chunk c feeds chunk c+1); each
pipeline rank holds `virtual_stages` of them. An `Action` is one pass of one microbatch through one
chunk: F (forward), B (the whole backward, or only its input-gradient half when the backward is
split) and W (the weight-gradient half, only when split). `Action.stage` is the chunk index.

Dependencies (see `dependencies`): F(i, c) needs F(i, c-1); B(i, c) needs F(i, c) and B(i, c+1);
W(i, c) needs B(i, c). A rank runs its list in order, each action waiting for its dependencies;
the runtime, the timeline, the tests and the planner all read these same lists.

GPipe, 1F1B and interleaved 1F1B are written out in closed form. The zero-bubble schedules are
found by a small list scheduler (`_zero_bubble_order`) that plays the pipeline forward in unit
time steps; what it returns is still a fixed list per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
_SPLIT_BACKWARD = ("zb-h1", "zb-v")
_NEED_FULL_PIPELINE = ("1f1b", "zb-h1", "zb-v")  # these assume m >= p (see microbatch_problems)


@dataclass(frozen=True)
class Action:
    op: str          # "F"; "B" (whole backward, or its input-gradient half when split); "W" (weight gradient)
    microbatch: int
    stage: int       # model chunk index 0..num_chunks-1; chunk c feeds chunk c+1


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int              # pipeline ranks p
    microbatches: int        # m
    virtual_stages: int      # chunks per rank v: 1 for gpipe/1f1b/zb-h1, v for interleaved-1f1b, 2 for zb-v
    split_backward: bool     # True for zb-h1 and zb-v: their backward is B (input grad) + W (weight grad)
    ranks: tuple[tuple[Action, ...], ...]   # ranks[r] = rank r's compute actions, in the order it runs them

    @property
    def num_chunks(self) -> int:
        return self.stages * self.virtual_stages

    def owner(self, chunk: int) -> int:
        """The pipeline rank that holds `chunk`."""
        if not 0 <= chunk < self.num_chunks:
            raise ValueError(f"chunk {chunk} out of range: {self.name} has chunks 0..{self.num_chunks - 1}")
        if self.name == "zb-v":
            # A V: down the ranks and back up, so rank 0 holds both the first and the last chunk
            # (its input and the loss) and each rank's two chunks do equal work.
            return chunk if chunk < self.stages else 2 * self.stages - 1 - chunk
        return chunk % self.stages  # interleaved: round-robin; one chunk per rank: chunk == rank

    def chunks_of(self, rank: int) -> list[int]:
        """The chunks on `rank`, in model order; the timeline's `.k` suffix indexes this list."""
        return [chunk for chunk in range(self.num_chunks) if self.owner(chunk) == rank]

    @property
    def last_backward_op(self) -> str:
        """The action after which a (microbatch, chunk)'s activations can be freed."""
        return "W" if self.split_backward else "B"


def dependencies(action: Action, num_chunks: int) -> list[Action]:
    """The actions that must finish before `action` can start (on any rank)."""
    i, c = action.microbatch, action.stage
    if action.op == "F":
        return [Action("F", i, c - 1)] if c > 0 else []
    if action.op == "B":
        # The last chunk computes the loss, so its backward starts right after its own forward.
        return [Action("F", i, c)] + ([Action("B", i, c + 1)] if c + 1 < num_chunks else [])
    if action.op == "W":
        return [Action("B", i, c)]
    raise ValueError(f"unknown op {action.op!r}: expected F, B or W")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def microbatch_problems(name, stages, microbatches, virtual_stages=1) -> list[str]:
    """Every reason these arguments cannot make a schedule, one line each (empty when fine)."""
    problems = []
    if name not in SCHEDULES:
        problems.append(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    sizes_ok = True
    for label, value in (("stages", stages), ("microbatches", microbatches), ("virtual stages", virtual_stages)):
        if not _is_int(value) or value < 1:
            problems.append(f"{label} must be an integer >= 1: got {value!r}")
            sizes_ok = False
    if name not in SCHEDULES or not sizes_ok:
        return problems
    p, m, v = stages, microbatches, virtual_stages
    if name == "interleaved-1f1b":
        if v < 2:
            problems.append(f"interleaved-1f1b needs at least 2 virtual stages (model chunks per rank): got {v}")
        # Megatron's ordering walks microbatches in groups of p, one group per chunk in turn.
        if m % p:
            problems.append(f"interleaved-1f1b needs microbatches to be a multiple of the stages ({p}): got {m}")
    elif name == "zb-v":
        if v not in (1, 2):  # 1 is the default, "not given"; the V always has two chunks per rank
            problems.append(f"zb-v always runs 2 model chunks per rank (a V): virtual stages must be 2: got {v}")
    elif v != 1:
        problems.append(f"{name} runs one model chunk per rank: virtual stages must be 1: got {v} "
                        "(use --schedule interleaved-1f1b for more)")
    if name in _NEED_FULL_PIPELINE and m < p:
        problems.append(f"{name} needs at least as many microbatches ({m}) as stages ({p}); "
                        "use --schedule gpipe for fewer")
    return problems


def build_schedule(name, stages, microbatches, virtual_stages=1) -> Schedule:
    """The schedule `name` for `stages` ranks and `microbatches` microbatches; ValueError if invalid."""
    problems = microbatch_problems(name, stages, microbatches, virtual_stages)
    if problems:
        raise ValueError("\n".join(problems))
    p, m = stages, microbatches
    if name == "gpipe":
        v, ranks = 1, _gpipe(p, m)
    elif name == "1f1b":
        v, ranks = 1, _one_f_one_b(p, m)
    elif name == "interleaved-1f1b":
        v, ranks = virtual_stages, _interleaved(p, m, virtual_stages)
    elif name == "zb-h1":
        # 1F1B's warm-up (at most p - r microbatches between F and B on rank r), and W passes
        # deferred while a rank holds fewer than p microbatches: 1F1B's peak, that of its rank 0.
        # Every rank gets p, not 1F1B's p - r, because the last ranks must defer p - 1 W's into
        # the cool-down; held to one, the last rank runs F B W back to back and the bubble stays
        # near two thirds of 1F1B's instead of one third.
        v = 1
        ranks = _zero_bubble_order(p, m, [[r] for r in range(p)],
                                   before_b_cap=[p - r for r in range(p)], before_w_cap=[p] * p)
    else:
        # Two half-size chunks per rank, so 2p (microbatch, chunk) pairs hold what p whole
        # microbatches hold: the ZB-V paper's budget, equal to 1F1B's rank 0.
        v = 2
        ranks = _zero_bubble_order(p, m, [[r, 2 * p - 1 - r] for r in range(p)],
                                   before_b_cap=[2 * p] * p, before_w_cap=[2 * p] * p)
    return Schedule(name, p, m, v, name in _SPLIT_BACKWARD, ranks)


def _gpipe(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple([Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)])
                 for r in range(p))


def _one_f_one_b(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    ranks = []
    for r in range(p):
        # Rank r runs p-r-1 forwards ahead: exactly enough that the first backward arrives as
        # its next forward ends, so at most p-r microbatches wait for a backward here.
        warmup = min(p - r - 1, m)
        order = [Action("F", i, r) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action("F", warmup + i, r), Action("B", i, r)]
        order += [Action("B", i, r) for i in range(m - warmup, m)]
        ranks.append(tuple(order))
    return tuple(ranks)


def _interleaved(p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """Megatron-LM's interleaved 1F1B: each rank holds chunks r, r+p, ..., r+(v-1)p and walks its
    m*v (microbatch, chunk) forwards in groups of p microbatches, chunk by chunk; backwards take the
    same walk with the chunks reversed."""
    def walk(op: str, k: int, r: int) -> Action:
        group, within = divmod(k, p * v)
        local = within // p
        if op == "B":
            local = v - 1 - local
        return Action(op, group * p + within % p, local * p + r)

    total = m * v
    ranks = []
    for r in range(p):
        # v-1 whole rounds of the pipeline fill the other chunks, plus 1F1B's lag of 2 slots per
        # rank (F and B alternate) before the first backward reaches rank r.
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        order = [walk("F", k, r) for k in range(warmup)]
        for k in range(total - warmup):
            order += [walk("F", warmup + k, r), walk("B", k, r)]
        order += [walk("B", k, r) for k in range(total - warmup, total)]
        ranks.append(tuple(order))
    return tuple(ranks)


def _zero_bubble_order(p, m, chunks, before_b_cap, before_w_cap) -> tuple[tuple[Action, ...], ...]:
    """A list scheduler with unit costs (F = B = W). `chunks[r]` lists rank r's chunks. At each
    time step every rank starts the first ready action, in this order of preference:

      1. F and B alternate, as in 1F1B: after a B the rank prefers an F, after an F a B.
         Preferring B always lets backwards bunch up and starves the ranks downstream of
         forwards: at p=4, m=8 that gave back over a third of ZB-H1's gain on 1F1B.
         B goes to the chunk nearest the model's input first: that microbatch is furthest
         through its backward. F goes to the chunk nearest the loss first: it reaches a backward
         soonest, and filling the memory cap with first-chunk forwards alone can deadlock.
         An F waits while the rank holds before_b_cap[r] pairs awaiting B or before_w_cap[r]
         awaiting W: that cap is the schedule's memory budget.
      2. W, the oldest: it needs nobody and unblocks nobody, so it fills what would be idle.

    Each chunk runs each op in microbatch order.
    """
    num_chunks = sum(len(c) for c in chunks)
    done_at: dict[Action, int] = {}
    next_mb = {op: [0] * num_chunks for op in "FBW"}  # next microbatch of each op, per chunk
    orders = [[] for _ in range(p)]

    def ready(op, chunk, t):
        action = Action(op, next_mb[op][chunk], chunk)
        deps = dependencies(action, num_chunks)
        if action.microbatch < m and all(done_at.get(d, t + 1) <= t for d in deps):
            return action
        return None

    t, remaining = 0, 3 * m * num_chunks
    while remaining:
        for r in range(p):
            own = chunks[r]
            awaiting_b = sum(next_mb["F"][c] - next_mb["B"][c] for c in own)
            awaiting_w = sum(next_mb["F"][c] - next_mb["W"][c] for c in own)
            backs = [("B", c) for c in sorted(own)]
            fores = [("F", c) for c in sorted(own, reverse=True)]
            if awaiting_b >= before_b_cap[r] or awaiting_w >= before_w_cap[r]:
                fores = []
            last = next((a.op for a in reversed(orders[r]) if a.op != "W"), "B")
            choices = fores + backs if last == "B" else backs + fores
            choices += [("W", c) for c in sorted(own, key=lambda c: next_mb["W"][c])]
            action = next((a for op, c in choices if (a := ready(op, c, t))), None)
            if action:
                orders[r].append(action)
                done_at[action] = t + 1
                next_mb[action.op][action.stage] += 1
                remaining -= 1
        t += 1
        if t > 3 * m * num_chunks * p:  # far past any sane makespan: the caps above have starved it
            raise RuntimeError(f"zero-bubble list scheduler is stuck at p={p}, m={m}: a bug in its caps")
    return tuple(tuple(order) for order in orders)

"""Every valid layout of a GPT on N devices, the ones that fit, ranked by predicted step time.

A layout is valid when paratrain (or Megatron) could run it: tp divides the heads and the MLP
and stays within a node, pp divides the layers (evenly per chunk when the profile's software
splits evenly), dp divides the global batch and the micro-batch divides each replica's share,
and the schedule accepts the microbatch count (schedules.microbatch_problems). Expert parallelism
(a mixture of experts only) takes its ranks from dp x cp and must divide them and the experts.

Searched schedules: 1f1b, interleaved-1f1b (2-4 chunks per rank), zb-h1 and zb-v. GPipe is left
out: it has 1F1B's bubble and holds every microbatch's activations. Recomputation is tried from
none to full and the first that fits is kept, since each step adds work and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from paratrain.parallel.pipeline import schedules
from paratrain.plan.cost_model import Prediction, predict
from paratrain.plan.flops import RECOMPUTE
from paratrain.plan.hardware import HardwareProfile
from paratrain.plan.memory import GIB, Layout, memory_per_gpu
from paratrain.plan.shapes import GPTShape

MICRO_BATCHES = (1, 2, 4, 8, 16)
MIN_CONTEXT_SHARD = 4096  # tokens a context-parallel rank keeps at least, when cp is searched
ZERO_BUBBLE_LIMIT = 512  # stages x microbatches above which zb-h1/zb-v are not searched (slow to build)


def layout_problems(shape: GPTShape, layout: Layout, global_batch: int, profile: HardwareProfile,
                    gpus: int | None = None) -> list[str]:
    """Every reason `layout` cannot run, one line each (empty when it can)."""
    problems = []
    if gpus is not None and layout.gpus != gpus:
        problems.append(f"tp x pp x cp x dp = {layout.gpus}, not the {gpus} GPUs given")
    if layout.cp > 1 and shape.seq % (2 * layout.cp):
        problems.append(f"the sequence ({shape.seq}) must divide by 2·cp = {2 * layout.cp} (zigzag context parallelism)")
    if shape.heads % layout.tp or (shape.mlp % layout.tp and not shape.experts):  # an MoE model's MLPs stay whole
        problems.append(f"tp {layout.tp} must divide the heads ({shape.heads}) and the MLP width ({shape.mlp})")
    elif shape.kv_heads % layout.tp:
        problems.append(f"tp {layout.tp} must divide the key/value heads ({shape.kv_heads})")
    problems += _expert_problems(shape, layout)
    if global_batch % layout.dp or (global_batch // layout.dp) % layout.micro_batch:
        problems.append(f"global batch {global_batch} must split into dp {layout.dp} replicas of whole "
                        f"micro-batches of {layout.micro_batch}")
        return problems
    if layout.recompute not in RECOMPUTE:
        problems.append(f"recompute must be one of {', '.join(RECOMPUTE)}: got {layout.recompute!r}")
    if layout.zero not in (0, 1, 2, 3):
        problems.append(f"zero must be 0, 1, 2 or 3: got {layout.zero}")
    if layout.sequence_parallel and layout.tp == 1:
        problems.append("sequence parallelism needs tp > 1")
    if layout.pp > 1:
        m = layout.microbatches(global_batch)
        problems += schedules.microbatch_problems(layout.schedule, layout.pp, m, layout.virtual_stages)
        chunks = layout.pp * (2 if layout.schedule == "zb-v" else layout.virtual_stages)
        if profile.software.even_layers and shape.layers % chunks:
            problems.append(f"{shape.layers} layers do not split evenly into {chunks} pipeline chunks")
        elif shape.layers + 2 < chunks:
            problems.append(f"{shape.layers} layers (+ embedding and head) are fewer than {chunks} chunks")
    return problems


def _expert_problems(shape: GPTShape, layout: Layout) -> list[str]:
    if shape.experts and layout.sequence_parallel:
        return ["sequence parallelism is not run with a mixture of experts (its MLPs are whole on every tp rank)"]
    if layout.ep == 1:
        return []
    if not shape.experts:
        return [f"ep {layout.ep}: expert parallelism needs a mixture of experts (moe-small, mixtral-8x7b, ...)"]
    if layout.replicas % layout.ep:
        return [f"ep {layout.ep} must divide dp x cp = {layout.replicas} (its ranks are data ranks)"]
    if shape.experts % layout.ep:
        return [f"ep {layout.ep} must divide the experts ({shape.experts})"]
    return []


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(shape: GPTShape, gpus: int, global_batch: int, profile: HardwareProfile) -> Iterator[Layout]:
    """Context parallelism is searched where the sequence is long enough for it to matter: each
    rank keeps at least MIN_CONTEXT_SHARD tokens (below that the ring's hops cannot hide)."""
    for tp in _divisors(gpus):
        if tp > profile.devices_per_node:
            continue
        for pp, cp in ((pp, cp) for pp in _divisors(gpus // tp) for cp in _divisors(gpus // (tp * pp))
                       if cp == 1 or shape.seq // cp >= MIN_CONTEXT_SHARD):
            dp = gpus // (tp * pp * cp)
            for mb in MICRO_BATCHES:
                base = Layout(tp, pp, dp, mb, cp=cp)
                for schedule, v in _schedules(pp, base.microbatches(global_batch) if global_batch % dp == 0 else 0):
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for zero, ep in ((z, e) for z in ((0, 1, 2, 3) if dp * cp > 1 else (0,))  # memory.py
                                         for e in _expert_ranks(shape, dp * cp)):
                            layout = replace(base, schedule=schedule, virtual_stages=v, sequence_parallel=sp,
                                             zero=zero, ep=ep)
                            if not layout_problems(shape, layout, global_batch, profile):
                                yield layout


def _expert_ranks(shape: GPTShape, replicas: int) -> list[int]:
    """ep to try: 1, and for a mixture of experts every divisor of dp x cp that divides the experts."""
    return [e for e in _divisors(replicas) if e == 1 or (shape.experts and shape.experts % e == 0)]


def _schedules(pp: int, m: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    found = [("1f1b", 1)] + [("interleaved-1f1b", v) for v in (2, 3, 4)]
    if pp * m <= ZERO_BUBBLE_LIMIT:
        found += [("zb-h1", 1), ("zb-v", 2)]
    return found


def search(shape: GPTShape, gpus: int, global_batch: int, profile: HardwareProfile) -> tuple[list[Prediction], dict]:
    """Predictions for the layouts that fit, fastest first, and what was dropped and why."""
    fitting, considered, too_big = [], 0, []
    for layout in candidate_layouts(shape, gpus, global_batch, profile):
        considered += 1
        for recompute in RECOMPUTE:
            candidate = replace(layout, recompute=recompute)
            memory = memory_per_gpu(shape, candidate, global_batch, profile.software)
            if memory.total <= profile.usable_bytes:
                fitting.append(predict(shape, candidate, profile, global_batch))
                break
        else:
            too_big.append(memory.total)  # even with full recomputation
    fitting.sort(key=lambda p: p.step_s)
    dropped = {"considered": considered, "do_not_fit": len(too_big),
               "smallest_that_does_not_fit_gib": min(too_big) / GIB if too_big else None}
    return fitting, dropped


_LABELS = {"compute": "compute", "tp_comm": "tp comm", "pp_comm": "pp comm", "cp_comm": "cp comm", "ep_comm": "ep comm",
           "bubble": "bubble", "dp_comm": "dp comm", "optimizer": "optimizer"}


def reason(prediction: Prediction, best: Prediction) -> str:
    """Why this layout wins, or what it loses to the best one, in a few words."""
    layout = prediction.layout
    if prediction is best:
        top = max(prediction.breakdown, key=prediction.breakdown.get)
        share = prediction.breakdown[top] / prediction.step_s
        needs = f"; {layout.recompute} recompute to fit" if layout.recompute != "none" else ""
        return f"fastest: {_LABELS[top]} {share:.0%} of the step{needs}"
    losses = sorted(((prediction.breakdown[k] - best.breakdown[k], k) for k in prediction.breakdown), reverse=True)
    parts = [f"+{delta:.3g} s {_LABELS[k]}" for delta, k in losses[:2] if delta > 0.05 * (prediction.step_s - best.step_s)]
    saved = best.memory.total - prediction.memory.total
    if saved > 0.05 * best.memory.total:
        parts.append(f"but {saved / GIB:.1f} GiB less memory" if saved >= GIB else f"but {saved / 2**20:.0f} MiB less memory")
    return ", ".join(parts) or "as fast, within rounding"

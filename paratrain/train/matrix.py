"""The parity matrix: every model x every data-parallel strategy x every layout, each cell either
trained against one process (`paratrain check`'s comparison and tolerances) or refused by the
configuration's validation, in one line, before any rank starts.

A feature is proven model by model, not only on the model it was written with: a new model adds
a row to MODELS, a new strategy is a new entry of parallel/data/strategy.py's table, a new axis a
layout here, and `paratrain matrix` (`make matrix`) shows at once what passes, what is refused
and why, and what fails.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

from paratrain.launch import run
from paratrain.parallel.data.strategy import STRATEGIES, Strategy
from paratrain.train.check import compare, passes, tolerances
from paratrain.train.config import ConfigError, TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.reference import reference_run
from paratrain.train.validate import validate

OWN_MODEL = Path(__file__).resolve().parents[2] / "examples" / "own_model"  # in a checkout of the repository
HF_EXAMPLES = OWN_MODEL.parent / "hf"

# Model rows: the config keys that pick each model (small shapes: a cell trains in about a second).
MODELS = {
    "mlp": {"model.name": "mlp"},
    "cnn": {"model.name": "cnn", "model.channels": (8, 16), "model.hidden": 32},
    "gpt-tiny": {"model.name": "gpt-tiny"},
    "llama-tiny": {"model.name": "llama-tiny"},
    "llama-tiny tied": {"model.name": "llama-tiny", "model.tie_embeddings": True},  # output shares tok_emb
    # transformers' own Llama, built from the shipped tiny configuration (the hf extra)
    "hf:llama": {"model.name": "hf:llama", "model.hf_config": str(HF_EXAMPLES / "llama-tiny.json")},
    "own model": {"model.name": f"{OWN_MODEL / 'model.py'}:build", "model.plan": str(OWN_MODEL / "plan.yaml")},
    "moe-tiny": {"model.name": "moe-tiny"},  # 8 experts, top-2, one shared, the balance loss on
}


@dataclass(frozen=True)
class Layout:
    name: str
    world: int
    tp: int = 1
    pp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1

    def overrides(self) -> dict:
        pipeline = {"parallel.microbatches": 2, "parallel.schedule": "1f1b"} if self.pp > 1 else {}
        return {"parallel.tp": self.tp, "parallel.pp": self.pp, "parallel.sequence_parallel": self.sp,
                "parallel.cp": self.cp, "parallel.ep": self.ep, **pipeline}


LAYOUTS = (
    Layout("dp 2", 2), Layout("tp 2", 2, tp=2), Layout("pp 2", 2, pp=2), Layout("sp 2", 2, tp=2, sp=True),
    Layout("dp 4", 4), Layout("tp 2 x dp 2", 4, tp=2), Layout("pp 2 x dp 2", 4, pp=2),
    Layout("sp 2 x dp 2", 4, tp=2, sp=True), Layout("cp 2", 2, cp=2), Layout("cp 2 x dp 2", 4, cp=2),
    Layout("ep 2", 2, ep=2), Layout("ep 2 x dp 2", 4, ep=2),
)
LAYOUT_NAMES = tuple(layout.name for layout in LAYOUTS)
# Each cell: a few steps of SGD with momentum on a global batch every layout divides.
COMMON = {"steps": 3, "data.global_batch": 8, "seed": 0, "log_every": 1_000_000}


def strategy_overrides(strategy: Strategy) -> dict:
    """Local SGD averages every step (period 1): only then is it the same model as one process."""
    launcher = "processes" if strategy.needs_process_group else "threads"
    period = {"parallel.local_sgd": 1} if strategy.name == "local-sgd" else {}
    return {"parallel.dp_mode": strategy.name, "parallel.launcher": launcher, **period}


def cell_config(model: str, strategy: str, layout: Layout) -> TrainConfig:
    overrides = {**COMMON, **MODELS[model], **strategy_overrides(STRATEGIES[strategy]), **layout.overrides(),
                 "parallel.nproc": layout.world}
    return apply_overrides(TrainConfig(), overrides)


def refusal(config: TrainConfig, world: int) -> str:
    """The one line validation refuses the cell with ('' : it runs)."""
    try:
        validate(config, world)
    except ConfigError as error:
        return error.problems[0]
    return ""


def _reference_key(config: TrainConfig) -> tuple:
    """What the single-process reference depends on: the layout is not part of it."""
    return (config.model.name, repr(sorted(config.model.overrides.items())), config.data.name, config.data.global_batch,
            repr(config.optim), config.steps, config.seed, config.parallel.precision)


def run_cell(model: str, strategy: str, layout: Layout, references: dict | None = None) -> dict:
    """{model, strategy, layout, world, status (PASS | FAIL | refused), reason, differences, seconds}."""
    started = time.perf_counter()
    config = cell_config(model, strategy, layout)
    record = {"model": model, "strategy": strategy, "layout": layout.name, "world": layout.world}
    reason = refusal(config, layout.world)
    if reason:
        return {**record, "status": "refused", "reason": reason, "seconds": time.perf_counter() - started}
    references = {} if references is None else references
    try:
        results = run(functools.partial(train_rank, return_state=True), layout.world,
                      launcher=config.parallel.launcher, args=(config,), timeout=120)
        key = _reference_key(config)
        if key not in references:
            references[key] = reference_run(config)
    except Exception as error:  # noqa: BLE001 - a cell that crashes is a FAIL with its reason, the grid goes on
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return {**record, "status": "FAIL", "reason": f"{type(error).__name__}: {first}",
                "seconds": time.perf_counter() - started}
    report = compare(config, results, references[key])
    ok = passes(report, tolerances(config))
    return {**record, "status": "PASS" if ok else "FAIL",
            "reason": "" if ok else f"beyond tolerance: loss {report['max_loss_diff']:.1e}, parameters "
                                    f"{report['max_param_diff']:.1e} ({report['worst_param']})",
            "max_loss_diff": report["max_loss_diff"], "max_param_diff": report["max_param_diff"],
            "seconds": time.perf_counter() - started}


def cells(models=None, strategies=None, layouts=None) -> list[tuple[str, str, Layout]]:
    """The grid (or the part of it named), row by row."""
    chosen = [layout for layout in LAYOUTS if layouts is None or layout.name in layouts]
    return [(model, strategy, layout) for model in (models or MODELS) for strategy in (strategies or STRATEGIES)
            for layout in chosen]


def render(records: list[dict]) -> list[str]:
    """One Markdown table per model (strategies x layouts), then the numbered refusal reasons."""
    reasons: dict[str, int] = {}

    def cell(record):
        if record["status"] != "refused":
            return record["status"] if record["status"] == "PASS" else f"**FAIL**: {record['reason']}"
        number = reasons.setdefault(record["reason"], len(reasons) + 1)
        return f"refused ({number})"

    counts = {status: sum(r["status"] == status for r in records) for status in ("PASS", "refused", "FAIL")}
    seconds = sum(r["seconds"] for r in records)
    lines = [f"{len(records)} cells: {counts['PASS']} PASS, {counts['refused']} refused before any rank starts, "
             f"{counts['FAIL']} FAIL; {seconds:.0f} s in all. Each cell trains {COMMON['steps']} steps (SGD with "
             f"momentum, global batch {COMMON['data.global_batch']}) against one process with `paratrain check`'s "
             "fp32 tolerances (losses 1e-5 relative, parameters 1e-5 absolute); local-sgd averages every step "
             "(--local-sgd 1), the period at which it is the same model. *sp* is tp with sequence parallelism; "
             "pp runs 1F1B with 2 microbatches."]
    for model in dict.fromkeys(r["model"] for r in records):
        rows = [r for r in records if r["model"] == model]
        layouts = list(dict.fromkeys(r["layout"] for r in rows))
        table = [[strategy] + [cell(next(r for r in rows if r["strategy"] == strategy and r["layout"] == layout))
                               for layout in layouts]
                 for strategy in dict.fromkeys(r["strategy"] for r in rows)]
        lines += ["", f"**{model}**", "", "| strategy | " + " | ".join(layouts) + " |",
                  "|---|" + "---|" * len(layouts)] + ["| " + " | ".join(row) + " |" for row in table]
    if reasons:
        lines += ["", "Refused, and why (the first line of the configuration's validation):", ""]
        lines += [f"{number}. {reason}" for reason, number in reasons.items()]
    return lines


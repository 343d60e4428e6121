"""`--log tensorboard:DIR[,wandb[:DIR]]`: the figures the run prints, where users watch them.

Rank 0 writes, once per step: the loss, the learning rate, the step, communication and exposed
communication times, tokens/s, the gradient norm, the validation loss when evaluated, and a
mixture of experts' load; at the end, the summary's memory per rank and MFU. No other rank
opens a file. The JSON log (`--metrics-out`) stays as it is.

TensorBoard goes through `torch.utils.tensorboard.SummaryWriter` (the `tensorboard` package, in
the `hf` extra); Weights & Biases through `wandb` when it is installed, offline unless WANDB_MODE
(read in environment.py) says otherwise. Neither is imported unless asked for.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from paratrain.environment import Settings

KINDS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # kind -> the module it needs
EXTRA = {"tensorboard": "pip install 'paratrain[hf]'", "wandb": "pip install wandb"}

# The log entry's keys and the tags they are written under.
STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "val_loss": "val/loss",
             "step_ms": "time/step_ms", "comm_ms": "time/comm_ms", "exposed_comm_ms": "time/exposed_comm_ms",
             "bubble": "time/bubble", "expert_imbalance": "experts/imbalance",
             "ep_rank_imbalance": "experts/ep_rank_imbalance", "dropped_pairs": "experts/dropped_pairs"}


@dataclass(frozen=True)
class Target:
    kind: str
    where: str | None  # the directory (tensorboard: required; wandb: optional)


def parse_targets(spec: str | None) -> list[Target]:
    """'tensorboard:runs/a,wandb' -> [Target('tensorboard', 'runs/a'), Target('wandb', None)]."""
    targets = []
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        kind, _, where = part.partition(":")
        targets.append(Target(kind, where or None))
    return targets


def target_problems(spec: str | None) -> list[str]:
    """One line per target that cannot be written: unknown, without its directory, or its package
    not installed (naming what to install)."""
    problems = []
    for target in parse_targets(spec):
        if target.kind not in KINDS:
            problems.append(f"log: unknown target {target.kind!r}; valid: tensorboard:DIR, wandb[:DIR]")
        elif target.kind == "tensorboard" and not target.where:
            problems.append("log: tensorboard needs a directory: --log tensorboard:DIR")
        elif importlib.util.find_spec(KINDS[target.kind]) is None:
            problems.append(f"log: {target.kind} is not installed: {EXTRA[target.kind]}")
    return problems


def _tensorboard(target: Target, config_text: str):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=target.where)
    writer.add_text("config", f"```\n{config_text}\n```")
    return writer.add_scalar, writer.close


def _wandb(target: Target, config: dict):
    import wandb

    run = wandb.init(mode=Settings.resolve().wandb_mode, dir=target.where, config=config)
    return (lambda tag, value, step: run.log({tag: value}, step=step)), run.finish


class MetricSinks:
    """What rank 0 writes to each --log target; nothing on the other ranks."""

    def __init__(self, rank: int, spec: str | None, config_dict: dict, config_text: str, tokens_per_step: int | None):
        self.writers, self.tokens_per_step = [], tokens_per_step
        if rank != 0:
            return
        for target in parse_targets(spec):
            opened = _tensorboard(target, config_text) if target.kind == "tensorboard" else _wandb(target, config_dict)
            self.writers.append(opened)

    def _write(self, tag: str, value: float, step: int) -> None:
        for add, _ in self.writers:
            add(tag, float(value), step)

    def step(self, entry: dict) -> None:
        if not self.writers:
            return
        step = entry["step"]
        for key, tag in STEP_TAGS.items():
            if key in entry:
                self._write(tag, entry[key], step)
        if self.tokens_per_step:
            self._write("throughput/tokens_per_s", self.tokens_per_step / (entry["step_ms"] / 1e3), step)

    def summary(self, summary: dict, step: int) -> None:
        """The run's end: memory per rank (largest over ranks, MiB) and MFU when known."""
        if not self.writers:
            return
        for key, values in summary.get("memory", {}).items():
            self._write(f"memory/{key.removesuffix('_bytes')}_mib", max(values) / 2**20, step)
        for key in ("mfu", "tflops_per_rank"):
            if key in summary:
                self._write(f"summary/{key}", summary[key], step)

    def close(self) -> None:
        for _, close in self.writers:
            close()
        self.writers = []

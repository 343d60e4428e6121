"""The checks on checkpoints before a run starts: how often and where to save, what restarts need,
which strategies cannot be checkpointed, and the checkpoint or Hugging Face directory a run
starts from (read whole here, before any rank reads it). One line each."""

from __future__ import annotations

from paratrain.parallel.data.strategy import StrategyError, strategy_of
from paratrain.paths import cannot_write
from paratrain.train.config import TrainConfig
from paratrain.train.hf_init import init_from_problems
from paratrain.train.validate_rules import at_least


def checkpoint_problems(problems: list[str], config: TrainConfig) -> None:
    ckpt, par = config.checkpoint, config.parallel
    at_least(problems, "checkpoint.every", ckpt.every, 0)
    at_least(problems, "checkpoint.keep", ckpt.keep, 1)
    at_least(problems, "checkpoint.max_restarts", ckpt.max_restarts, 0)
    if (ckpt.every or ckpt.max_restarts) and not ckpt.dir:
        problems.append("checkpoint: --save-every and --max-restarts need --save-dir (where checkpoints go)")
    if ckpt.max_restarts and par.launcher != "processes":
        problems.append("checkpoint.max_restarts needs --launcher processes (ranks on threads cannot restart)")
    try:
        strategy = strategy_of(par)
    except StrategyError:
        strategy = None  # reported with the strategy's problems
    if ckpt.dir and strategy is not None and strategy.no_checkpoint:
        problems.append(f"checkpoint: {strategy.no_checkpoint}; checkpoints are refused with {strategy.name}")
    if ckpt.dir and par.compress.startswith("topk"):
        problems.append("checkpoint: top-k compression keeps per-rank error-feedback residuals that a "
                        "checkpoint does not hold; use --compress fp16/bf16/none with --save-dir")
    if ckpt.dir:
        reason = cannot_write(ckpt.dir, directory=True)
        if reason:
            problems.append(f"checkpoint.dir: cannot write {ckpt.dir}: {reason}")
    problems += init_from_problems(config)
    if ckpt.resume is not None:
        from paratrain.train.checkpoint import CheckpointError, resolve
        from paratrain.train.resume import checked_reader

        try:
            checked_reader(resolve(ckpt.resume, ckpt.dir), config)  # the whole checkpoint, before any rank reads it
        except CheckpointError as error:
            problems.append(f"checkpoint.resume: {error}")

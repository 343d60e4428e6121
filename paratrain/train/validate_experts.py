"""The checks on a mixture of experts and expert parallelism, before any rank starts: one line
each (train/validate.py runs them with the rest)."""

from __future__ import annotations

from paratrain.models import model_config
from paratrain.models.moe_llama import MoEConfig
from paratrain.parallel.data.strategy import StrategyError, strategy_of
from paratrain.train.validate_rules import is_int

# Strategies that take the experts out of their own reduction (parallel/data/base.py's
# data_parallel_parameters): ours; PyTorch's wrap every parameter, local SGD averages them all.
EXPERT_STRATEGIES = ("naive", "ddp", "zero1", "zero2", "fsdp")



def expert_problems(problems: list[str], config, world_size: int) -> None:
    par = config.parallel
    if not is_int(par.ep) or par.ep < 1:
        problems.append(f"parallel.ep must be a positive integer, got {par.ep!r}")
        return
    try:
        shape = model_config(config.model.name, **config.model.overrides)
    except (ValueError, TypeError):
        return  # reported with the model's problems
    moe = isinstance(shape, MoEConfig)
    if moe and is_int(par.cp) and par.cp > 1:
        if shape.aux_loss_coef:
            problems.append("parallel.cp: the balance loss is per sequence and a cp rank holds part of each; "
                            "set the model's aux_loss_coef to 0 (or use bias_update_rate) under context parallelism")
        if shape.capacity_factor is not None:
            problems.append("parallel.cp: capacity drops tokens in sequence order, which a cp rank holds part "
                            "of; use dropless routing (capacity_factor null) under context parallelism")
    if moe and par.sequence_parallel:
        problems.append("parallel.sequence_parallel: not with a mixture of experts yet (its layer runs whole on "
                        "every tp rank, and its output is not cut back to each rank's tokens); use tp without it")
    if par.ep == 1:
        return
    if not moe:
        problems.append(f"parallel.ep: expert parallelism splits a mixture of experts' experts; "
                        f"{config.model.name!r} has none (moe-tiny, moe-small, ...)")
        return
    replicas = world_size // par.replica_ranks if all(is_int(v) and v > 0 for v in (par.pp, par.cp, par.tp)) else 0
    if replicas and (replicas * par.cp) % par.ep:
        problems.append(f"parallel.ep: ep ({par.ep}) must divide dp x cp = {replicas * par.cp}: the experts' "
                        "ranks are data ranks")
    if shape.n_experts % par.ep:
        problems.append(f"parallel.ep: ep ({par.ep}) must divide the experts ({shape.n_experts}): each rank holds "
                        "as many")
    try:
        strategy = strategy_of(par)
    except StrategyError:
        return  # reported with the strategy's problems
    if strategy.name not in EXPERT_STRATEGIES:
        problems.append(f"parallel.ep: data parallelism {strategy.name} cannot run with ep > 1 (use "
                        f"{', '.join(EXPERT_STRATEGIES)}: the experts are reduced over the ranks holding them)")
    if par.precision == "fp16":
        problems.append("parallel.ep: fp16 loss scaling does not cover the experts yet; use bf16 or fp32")

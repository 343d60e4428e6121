"""Every check a configuration must pass before a rank starts: one line per problem, all at once,
so a user fixes them in one go instead of one failed launch at a time."""

from __future__ import annotations

import functools

from paratrain.comm.algorithms import algorithms_for
from paratrain.data import DATASET_NAMES, build_dataset, dataset_config
from paratrain.data.user_data import is_data_file
from paratrain.data.text import is_text_name
from paratrain.data.token_file import is_token_file_name
from paratrain.launch import LAUNCHERS, check_simulated_hosts
from paratrain.models.user_model import load_function
import torch

from paratrain.models import CAUSAL_LM_CONFIGS, MODEL_NAMES, DeepMLPConfig, GPTConfig, MLPConfig, \
    is_model_file, is_model_name, model_config
from paratrain.parallel.context.attention import METHODS as CONTEXT_METHODS
from paratrain.parallel.context.layout import LAYOUTS as CONTEXT_LAYOUTS, length_problem
from paratrain.parallel.precision import PRECISIONS
from paratrain.parallel.data.strategy import StrategyError, strategy_of, strategy_problems
from paratrain.parallel.data.compression import build_compressor
from paratrain.parallel.data.naive import LAYOUTS
from paratrain.parallel.pipeline.schedules import microbatch_problems
from paratrain.parallel.pipeline.split import pipeline_layers
from paratrain.parallel.plan import PlanError, pipeline_problems, tp_problems_of
from paratrain.parallel.tensor.gpt import tp_problems
from paratrain.paths import cannot_write
from paratrain.environment import Settings, compile_backend_problem
from paratrain.train.config import ConfigError, TrainConfig
from paratrain.train.metric_sinks import target_problems
from paratrain.train.validate_checkpoint import checkpoint_problems
from paratrain.train.validate_experts import expert_problems
from paratrain.train.validate_rules import at_least as _at_least, choice as _choice, is_int as _is_int, \
    is_number as _is_number
from paratrain.train.setup import data_choice, meta_model, plan_for

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "constant")


def problems_with(config: TrainConfig, world_size: int) -> list[str]:
    """Every problem of `config` on `world_size` ranks, one line each, in the checks' order."""
    problems: list[str] = []
    for check in _CHECKS:
        check(problems, config, world_size)
    return problems


def _model_problems(problems: list[str], config: TrainConfig, world_size: int) -> None:
    model = config.model
    if not is_model_name(model.name):
        problems.append(f"model: unknown model {model.name!r}; valid: {', '.join(MODEL_NAMES)}, FILE.py:FUNCTION "
                        "or hf:FAMILY")
    else:
        try:
            model_config(model.name, **model.overrides)
        except (ValueError, TypeError) as error:
            problems.append(f"model: {error}")


def _run_problems(problems: list[str], config: TrainConfig, world_size: int) -> None:
    """How long the run is, what it logs and writes, and what --compile needs."""
    if config.parallel.compile:
        problem = compile_backend_problem(Settings.resolve().compile_backend)
        problems += [problem] if problem else []
    _at_least(problems, "steps", config.steps, 1)
    _at_least(problems, "log_every", config.log_every, 1)
    _at_least(problems, "eval_every", config.eval_every, 0)
    if not _is_int(config.seed):
        problems.append(f"seed must be an integer, got {config.seed!r}")
    problems += target_problems(config.log)
    if config.metrics_out:
        reason = cannot_write(config.metrics_out)
        if reason:
            problems.append(f"metrics_out: cannot write {config.metrics_out}: {reason}")


def _optimizer_problems(problems: list[str], config: TrainConfig, world_size: int) -> None:
    optim = config.optim
    _choice(problems, "optim.name", optim.name, OPTIMIZERS)
    _choice(problems, "optim.schedule", optim.schedule, SCHEDULES)
    if not _is_number(optim.lr) or optim.lr <= 0:
        problems.append(f"optim.lr must be a finite number > 0, got {optim.lr!r}")
    if not _is_number(optim.momentum) or not 0 <= optim.momentum < 1:
        problems.append(f"optim.momentum must be in [0, 1), got {optim.momentum!r}")
    _at_least(problems, "optim.weight_decay", optim.weight_decay, 0, "number")
    _at_least(problems, "optim.warmup_steps", optim.warmup_steps, 0)
    _at_least(problems, "optim.clip_grad_norm", optim.clip_grad_norm, 0, "number")
    _at_least(problems, "profile_steps", config.profile_steps, 1)
    if config.peak_tflops is not None and (not _is_number(config.peak_tflops) or config.peak_tflops <= 0):
        problems.append(f"peak_tflops must be a finite number > 0 (TFLOP/s per device), got {config.peak_tflops!r}")
    if not _is_number(optim.min_lr_ratio) or not 0 <= optim.min_lr_ratio <= 1:
        problems.append(f"optim.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio!r}")


def _layout_problems(problems: list[str], config: TrainConfig, world_size: int) -> None:
    """The launch, and the options that shape the pipeline or the data-parallel strategy."""
    par = config.parallel
    if par.nproc is not None:  # None: dp x pp x tp (see options.world_size_of)
        _at_least(problems, "parallel.nproc", par.nproc, 1)
    _choice(problems, "parallel.launcher", par.launcher, LAUNCHERS)
    _hosts_problems(problems, par, world_size)
    _choice(problems, "parallel.algo", par.algo, algorithms_for("all_reduce"))
    if _is_int(par.pp) and par.pp == 1:
        ignored = [flag for flag, on in (("--microbatches", par.microbatches != 1), ("--schedule", par.schedule != "1f1b"),
                                         ("--virtual-stages", par.virtual_stages != 1)) if on]
        if ignored:
            problems.append(f"parallel: {', '.join(ignored)} shape the pipeline and need pp > 1 "
                            "(for micro-batches without a pipeline use --grad-accum)")
    elif _is_int(par.grad_accum) and par.grad_accum > 1:
        problems.append("parallel.grad_accum: with pp > 1 the pipeline's --microbatches split the batch; "
                        "--grad-accum applies to pp = 1")
    tp_pp = par.pp * par.tp if _is_int(par.pp) and _is_int(par.tp) else 1
    problems += strategy_problems(par, tp_pp, algorithms_for("all_reduce"), algorithms_for)


def _hosts_problems(problems: list[str], par, world_size: int) -> None:
    """--simulate-hosts: processes, an even share of ranks per host."""
    if par.simulate_hosts in (0, None):
        return
    if not _is_int(par.simulate_hosts) or par.simulate_hosts < 1:
        problems.append(f"parallel.simulate_hosts must be a whole number >= 1, got {par.simulate_hosts!r}")
        return
    try:
        check_simulated_hosts(par.simulate_hosts, world_size, par.launcher)
    except ValueError as error:
        problems.append(f"parallel.simulate_hosts: {error}")


def _communication_problems(problems: list[str], config: TrainConfig, world_size: int) -> None:
    """The data-parallel strategy's own options: compression, buckets, prefetch, timeout."""
    par = config.parallel
    if str(par.compress).startswith("topk") and par.algo in algorithms_for("all_reduce") \
            and par.algo not in algorithms_for("all_gather"):  # top-k gathers the kept values
        problems.append(f"parallel.algo: {par.algo!r} has no all_gather (top-k compression uses it); "
                        f"valid: {', '.join(algorithms_for('all_gather'))}")
    _choice(problems, "parallel.naive_layout", par.naive_layout, LAYOUTS)
    if not _is_number(par.bucket_mb) or par.bucket_mb <= 0:
        problems.append(f"parallel.bucket_mb must be a finite number > 0, got {par.bucket_mb!r}")
    if not _is_number(par.first_bucket_mb) or par.first_bucket_mb <= 0:
        problems.append(f"parallel.first_bucket_mb must be a finite number > 0, got {par.first_bucket_mb!r}")
    _at_least(problems, "parallel.grad_accum", par.grad_accum, 1)
    _at_least(problems, "parallel.local_sgd", par.local_sgd, 0)
    _at_least(problems, "parallel.prefetch", par.prefetch, 0)
    if not isinstance(par.reshard_after_forward, bool):
        problems.append(f"parallel.reshard_after_forward must be true or false, got {par.reshard_after_forward!r}")
    if par.timeout is not None and (not _is_number(par.timeout) or par.timeout <= 0):
        problems.append(f"parallel.timeout must be a finite number of seconds > 0, got {par.timeout!r}")
    try:
        build_compressor(par.compress)
    except (ValueError, TypeError, AttributeError) as error:
        problems.append(f"parallel.compress: {error}")


def _batch_problems(problems: list[str], config: TrainConfig, world_size: int) -> None:
    """The mesh, and a global batch that splits over it (into micro-batches or accumulation)."""
    data, par = config.data, config.parallel
    mesh_ok, dp_size = _mesh_problems(problems, config, world_size)
    if not (_is_int(data.global_batch) and data.global_batch >= 1):
        problems.append(f"data.global_batch must be an integer >= 1, got {data.global_batch!r}")
        return
    accum_ok = _is_int(par.grad_accum) and par.grad_accum >= 1  # else said among the communication problems
    if mesh_ok and par.pp > 1 and _is_int(par.microbatches) and par.microbatches >= 1:
        if data.global_batch % (dp_size * par.microbatches):
            problems.append(
                f"data.global_batch {data.global_batch} is not divisible by dp x microbatches = "
                f"{dp_size} x {par.microbatches} = {dp_size * par.microbatches}"
            )
    elif mesh_ok and accum_ok and data.global_batch % (dp_size * par.grad_accum):
        problems.append(
            f"data.global_batch {data.global_batch} is not divisible by data-parallel size "
            f"{dp_size} x grad_accum {par.grad_accum} = {dp_size * par.grad_accum}"
        )


def _data_problems(problems: list[str], config: TrainConfig, world_size: int) -> None:
    """The data set must exist, suit the model and (text) its file be there and long enough."""
    name = config.data.name
    loss = config.data.loss
    if loss is not None:  # loaded here, so a missing file or function is one line before any rank starts
        try:
            if not is_model_file(loss):
                raise ValueError(f"a loss is FILE.py:FUNCTION, got {loss!r}")
            load_function(loss, "loss")
        except ValueError as error:
            problems.append(f"data.loss: {error}")
    if is_data_file(name):  # built once here: its items are checked before any rank starts
        try:
            build_dataset("user", config.seed, spec=name)
        except ValueError as error:
            problems.append(f"data.name: {error}")
        return
    if name is not None and not is_text_name(name) and not is_token_file_name(name):
        _choice(problems, "data.name", name, DATASET_NAMES + ("text:PATH", "tokens:PATH[:uint32]"))
        if name not in DATASET_NAMES:
            return
    try:
        model_config(config.model.name, **config.model.overrides)
    except (ValueError, TypeError):
        return  # reported with the model's problems
    try:
        data_name, options = data_choice(config.model.name, config.model.overrides, name)
        dataset_config(data_name, **options)
    except ValueError as error:
        problems.append(f"data.name: {error}")


def _mesh_problems(problems: list[str], config: TrainConfig, world_size: int) -> tuple[bool, int]:
    """Checks of the dp x pp x tp layout; returns (layout usable, data-parallel size)."""
    par, model = config.parallel, config.model
    ok = (_at_least(problems, "parallel.pp", par.pp, 1) & _at_least(problems, "parallel.tp", par.tp, 1)
          & _at_least(problems, "parallel.cp", par.cp, 1))
    if not ok:
        return False, world_size
    layout_ok = True
    names, sizes = ("pp x cp x tp", f"{par.pp} x {par.cp} x {par.tp}") if par.cp > 1 else ("pp x tp", f"{par.pp} x {par.tp}")
    if world_size % par.replica_ranks:
        problems.append(f"world size {world_size} is not divisible by {names} = {sizes} = {par.replica_ranks}")
        layout_ok = False
    elif par.dp is not None and par.dp * par.replica_ranks != world_size:
        problems.append(f"world size {world_size} != dp x {names} = {par.dp} x {sizes} = {par.dp * par.replica_ranks}")
        layout_ok = False
    dp_size = max(world_size // par.replica_ranks, 1)
    _choice(problems, "parallel.precision", par.precision, PRECISIONS)
    if not _is_number(par.loss_scale) or not 1 <= par.loss_scale < 2.0**127:
        problems.append(f"parallel.loss_scale must be a number in [1, 2^127), got {par.loss_scale!r}")
    if par.sequence_parallel and par.tp == 1:
        problems.append("parallel.sequence_parallel needs tp > 1")
    if not is_model_name(model.name):
        return False, dp_size
    try:
        shape = model_config(model.name, **model.overrides)
    except (ValueError, TypeError):
        return False, dp_size  # already reported
    chunks = par.pp * (2 if par.schedule == "zb-v" else par.virtual_stages) if _is_int(par.virtual_stages) else par.pp
    meta = functools.cache(lambda: _meta_model_and_plan(config))  # built once, when a check needs it
    if par.tp > 1 and not isinstance(shape, CAUSAL_LM_CONFIGS):
        problems.append(f"parallel.tp: tensor parallelism shards language models (GPT, Llama, FILE.py:FUNCTION "
                        f"with a plan); {model.name!r} is not one")
    elif par.tp > 1 and isinstance(shape, GPTConfig) and tp_problems(shape, par.tp):
        problems += [f"parallel.tp: {line}" for line in tp_problems(shape, par.tp)]
    elif par.tp > 1 and getattr(shape, "tp_refused", None):
        problems.append(f"parallel.tp: {shape.tp_refused}")
    elif par.tp > 1 or (par.pp > 1 and isinstance(shape, CAUSAL_LM_CONFIGS)):
        problems += _plan_problems(config, shape, chunks, meta)
        if par.tp > 1 and config.data.loss is not None and not problems and _splits_the_vocabulary(meta):
            problems.append(f"data.loss: {config.data.loss} needs whole logits, and the plan's vocabulary-parallel "
                            "head leaves each tp rank 1/tp of them (its loss is our sharded cross-entropy): use "
                            "tp 1, or a plan whose head is column-parallel with gathered outputs, or no --loss")
    if par.pp > 1:
        problems += microbatch_problems(par.schedule, par.pp, par.microbatches, par.virtual_stages)
        layers = _pipeline_layer_count(shape, config, meta)
        if layers is None:
            if not isinstance(shape, CAUSAL_LM_CONFIGS):  # a language model's: its plan's problem, above
                problems.append(f"parallel.pp: model {model.name!r} cannot be split into pipeline stages")
        elif _is_int(par.virtual_stages) and layers < chunks:
            problems.append(
                f"model {model.name!r} has {layers} pipeline layers, fewer than stages x virtual stages = {chunks}"
            )
        elif par.stage_layers is not None and (len(par.stage_layers) != chunks or sum(par.stage_layers) != layers
                                               or min(par.stage_layers) < 1):
            problems.append(
                f"parallel.stage_layers {par.stage_layers} must be {chunks} positive counts adding up to {layers}"
            )
    return layout_ok, dp_size


def _splits_the_vocabulary(meta) -> bool:
    _, plan = meta()
    return plan is not None and any(style.name == "vocab_head" for style in plan.tensor_parallel.values())


def _meta_model_and_plan(config: TrainConfig):
    """The model built on the meta device (shapes only: no memory, no time) and its plan."""
    model = meta_model(config.model.name, config.model.overrides)
    return model, plan_for(config.model.plan, model)


def _plan_problems(config: TrainConfig, shape, chunks: int, meta) -> list[str]:
    """The plan's problems with this model and layout, each one line naming the module."""
    par = config.parallel
    try:
        model, plan = meta()
    except (PlanError, ValueError) as error:
        return [f"model.plan: {error}"]
    if plan is None:
        return [f"model.plan: {config.model.name} has no parallelism plan of its own; give one with --plan"]
    problems = []
    if par.tp > 1:
        sp = par.sequence_parallel or plan.sequence_parallel
        problems += tp_problems_of(model, plan, par.tp, sp, shape.block_size)
    if par.pp > 1:
        problems += pipeline_problems(model, plan, chunks)
    return [f"model.plan: {line}" for line in problems]


def _pipeline_layer_count(shape, config: TrainConfig, meta) -> int | None:
    """How many layers pipeline_layers() would make of the model (see parallel/pipeline/split.py)."""
    if isinstance(shape, CAUSAL_LM_CONFIGS):
        try:
            model, plan = meta()
            return len(pipeline_layers(model, plan))
        except (PlanError, ValueError):
            return None
    if isinstance(shape, DeepMLPConfig):
        return shape.depth
    if isinstance(shape, MLPConfig):
        return 2
    return None


# Every check problems_with runs, in the order their lines are reported.
def _context_problems(problems: list[str], config: TrainConfig, world_size: int) -> None:
    """Context parallelism: a language model whose plan names its attention, sequences that split
    over cp, and a strategy that reduces gradients over every rank holding the parameters."""
    par = config.parallel
    _choice(problems, "parallel.cp_method", par.cp_method, (*CONTEXT_METHODS, "auto"))
    _choice(problems, "parallel.cp_layout", par.cp_layout, CONTEXT_LAYOUTS)
    if not (_is_int(par.cp) and par.cp > 1) or par.cp_layout not in CONTEXT_LAYOUTS:
        return  # cp itself is checked with the mesh
    try:
        shape = model_config(config.model.name, **config.model.overrides)
    except (ValueError, TypeError):
        return  # reported with the model's problems
    if not isinstance(shape, CAUSAL_LM_CONFIGS):
        problems.append(f"parallel.cp: context parallelism splits the sequences of language models (GPT, Llama, "
                        f"FILE.py:FUNCTION with a plan); {config.model.name!r} is not one")
        return
    length = length_problem(shape.block_size, par.cp, par.cp_layout)
    problems += [f"parallel.cp: {length} (the model's block_size)"] if length else []
    if getattr(shape, "dropout", 0):
        problems.append(f"parallel.cp: attention dropout ({shape.dropout}) is not supported under context "
                        "parallelism; set the model's dropout to 0")
    if par.compile:
        problems.append("parallel.cp: --compile with context parallelism is not supported yet")
    try:
        strategy = strategy_of(par)
        if not strategy.ours or strategy.name == "local-sgd":
            problems.append(f"parallel.cp: data parallelism {strategy.name} cannot run with cp > 1 (use ddp, naive "
                            "or zero 1/2/3: the cp ranks must reduce gradients every step, over dp x cp)")
    except StrategyError:
        pass  # reported with the strategy's problems
    try:
        _, plan = _meta_model_and_plan(config)
    except (PlanError, ValueError):
        return  # reported with the plan's problems
    if plan is None or plan.context is None:
        problems.append(f"model.plan: {config.model.name} has no context_parallel section (the attention modules "
                        "and position buffers --cp needs; docs/context.md)")


_CHECKS = (_model_problems, _data_problems, _run_problems, _optimizer_problems, _layout_problems,
           _communication_problems, _batch_problems, _context_problems, expert_problems)


def validate(config: TrainConfig, world_size: int) -> None:
    problems = problems_with(config, world_size)
    checkpoint_problems(problems, config)
    if problems:
        raise ConfigError(problems)

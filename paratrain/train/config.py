"""Training configuration: typed dataclasses, loaded from YAML, overridden by flags, validated
once before any rank starts.

A YAML file mirrors the sections below:

    steps: 100
    model: {name: cnn, channels: [32, 64, 128], hidden: 512}
    data: {global_batch: 128}
    optim: {name: adamw, lr: 0.001, warmup_steps: 10}
    parallel: {nproc: 4, dp_mode: ddp, bucket_mb: 10}

Keys of `model` other than `name` override the model preset's fields (see
paratrain/models/__init__.py for each preset's fields).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path


from paratrain.errors import Problems, UnreadableYaml, read_yaml


@dataclass
class ModelConfig:
    name: str = "mlp"  # a preset, or a user's model as FILE.py:FUNCTION
    overrides: dict = field(default_factory=dict)  # preset fields to change, e.g. {"hidden": 512}
    plan: str | None = None  # parallelism plan (YAML); None: the model's own (GPT, Llama)


@dataclass
class DataConfig:
    name: str | None = None  # None: the data set the model is made for (see train/setup.py)
    global_batch: int = 64  # samples per optimizer step across all ranks: fixed, whatever the world size
    loss: str | None = None  # FILE.py:FUNCTION (outputs, targets) -> mean loss; None: the data set's own


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd (with momentum) or adamw
    lr: float = 0.05  # peak learning rate, reached after warm-up
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.0
    warmup_steps: int = 0  # linear ramp from lr/warmup_steps to lr
    schedule: str = "cosine"  # after warm-up: cosine decay to min_lr_ratio*lr, or constant
    min_lr_ratio: float = 0.1
    clip_grad_norm: float = 0.0  # > 0: scale gradients so their global 2-norm is at most this; 0: off


@dataclass
class ParallelConfig:
    nproc: int | None = None  # ranks to start: None means dp x pp x tp, or 2 (ignored under torchrun)
    launcher: str = "threads"  # threads: in-process fabric; processes: torch's elastic launcher
    simulate_hosts: int = 0  # processes: this machine plays N hosts, a block of consecutive ranks each
    dp_mode: str | None = None  # a strategy of parallel/data/strategy.py; None: what zero and local_sgd say, else ddp
    algo: str = "auto"  # all-reduce algorithm for our modes
    naive_layout: str = "flat"  # naive: one flat buffer, or one all-reduce per parameter
    bucket_mb: float = 25.0  # ddp/torch bucket size; PyTorch's default
    first_bucket_mb: float = 1.0  # ddp: a small first bucket starts communicating sooner
    grad_accum: int = 1  # micro-batches per step; only the last one communicates
    compress: str = "none"  # none | fp16 | bf16 | topk:RATIO (naive and ddp)
    local_sgd: int = 0  # K > 0: no gradient all-reduce, average parameters every K steps
    zero: int = 0  # ZeRO stage: 1 optimizer state, 2 and gradients, 3 and parameters (FSDP) sharded
    reshard_after_forward: bool = True  # zero 3: free a unit's gathered parameters after its forward
    prefetch: int = 1  # zero 3: units whose all-gather starts ahead of their use (0: none)
    pp: int = 1  # pipeline stages; data-parallel size = world / (pp * cp * tp)
    tp: int = 1  # tensor-parallel ranks per stage (adjacent ranks, as in Megatron)
    cp: int = 1  # context-parallel ranks: each holds 1/cp of every sequence (parallel/context)
    cp_method: str = "ring"  # ring: K/V passed round the cp ranks; allgather: gathered once per layer; auto: the planner picks
    cp_layout: str = "zigzag"  # zigzag (balanced causal work) or contiguous
    ep: int = 1  # expert-parallel ranks, taken from dp x cp: each holds 1/ep of every MoE layer's experts
    dp: int | None = None  # if given, must equal world / (pp * cp * tp): a check on the arithmetic
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved-1f1b | zb-h1 | zb-v
    microbatches: int = 1  # per step, with pp > 1 (with pp = 1 use grad_accum)
    virtual_stages: int = 1  # chunks per pipeline rank (interleaved-1f1b; zb-v uses 2)
    stage_layers: list[int] | None = None  # explicit layers per chunk; None: balanced by cost
    checkpoint_activations: bool = False  # recompute each layer's activations in backward
    compile: bool = False  # each layer through torch.compile (after two eager steps, to compare)
    precision: str = "fp32"  # fp32, bf16 or fp16 (autocast; fp16 with dynamic loss scaling)
    loss_scale: float = 65536.0  # fp16: the initial loss scale (halved on overflow, doubled after 2000 good steps)
    sequence_parallel: bool = False  # shard norms/dropout regions on the sequence dim (tp > 1)
    timeout: float | None = None  # seconds per blocking operation (None: PARATRAIN_TIMEOUT or 300)
    debug: bool = False  # check every collective is the same call on all ranks

    @property
    def replica_ranks(self) -> int:
        """Ranks one data-parallel replica spans: pp x cp x tp (the world is dp of them)."""
        return self.pp * self.cp * self.tp


@dataclass
class CheckpointConfig:
    dir: str | None = None  # where checkpoints go (DIR/step-000100/); None: none are saved
    every: int = 0  # steps between saves (0: only at the end, when dir is set)
    keep: int = 3  # complete checkpoints kept; older ones are deleted after each save
    resume: str | None = None  # "latest" (in dir) or a checkpoint's path; None: start fresh
    init_from: str | None = None  # a Hugging Face model directory whose weights the run starts from (fresh optimizer)
    max_restarts: int = 0  # processes launcher: restart the ranks this often, resuming each time


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    steps: int = 50
    seed: int = 0  # model initialisation and data: same seed, same losses
    log_every: int = 10  # steps between lines of the printed log
    metrics_out: str | None = None  # JSON file for the per-step log and the summary
    log: str | None = None  # also log to: tensorboard:DIR and/or wandb[:DIR], comma-separated (rank 0 writes)
    eval_every: int = 0  # steps between validation losses (and one at the last step); 0: none
    profile: str | None = None  # directory for a torch.profiler trace of `profile_steps` steps (trace.json)
    profile_steps: int = 2  # steps profiled, after the first
    peak_tflops: float | None = None  # per device, for MFU in the summary; None: TFLOP/s achieved only


_SECTIONS = {
    "model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
}


class ConfigError(Problems, ValueError):
    """One or more problems with a configuration; each is one line of the message."""


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def from_dict(raw: dict, source: str = "config") -> TrainConfig:
    """Build a TrainConfig from nested dicts (as read from YAML); unknown keys are errors."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{source}: expected a mapping at the top level, got {type(raw).__name__}"])
    problems = []
    config = TrainConfig()
    top_fields = [n for n in _field_names(TrainConfig) if n not in _SECTIONS]
    for key, value in raw.items():
        if key in _SECTIONS:
            if not isinstance(value, dict):
                problems.append(f"{source}: '{key}' must be a mapping, got {value!r}")
                continue
            problems += _fill_section(getattr(config, key), key, value, source)
        elif key in top_fields:
            setattr(config, key, value)
        else:
            valid = ", ".join(list(_SECTIONS) + top_fields)
            problems.append(f"{source}: unknown key '{key}'; valid: {valid}")
    if problems:
        raise ConfigError(problems)
    return config


def _fill_section(section, name: str, values: dict, source: str) -> list[str]:
    problems = []
    valid = _field_names(type(section))
    for key, value in values.items():
        if name == "model" and key not in valid:
            section.overrides[key] = value  # checked against the preset by validate()
        elif key in valid:
            setattr(section, key, value)
        else:
            problems.append(f"{source}: unknown key '{name}.{key}'; valid: {', '.join(valid)}")
    return problems


def load_yaml(path: str | Path) -> TrainConfig:
    path = Path(path)
    try:
        raw = read_yaml(path, "config")
    except UnreadableYaml as error:
        raise ConfigError([str(error)]) from None
    return from_dict(raw, str(path))


def apply_overrides(config: TrainConfig, overrides: dict[str, object]) -> TrainConfig:
    """Set dotted keys ('optim.lr', 'steps', 'model.hidden'); command-line flags use this."""
    for dotted, value in overrides.items():
        if value is None:
            continue
        if "." not in dotted:
            setattr(config, dotted, value)
            continue
        section_name, key = dotted.split(".", 1)
        section = getattr(config, section_name)
        if section_name == "model" and key not in _field_names(ModelConfig):
            section.overrides[key] = value
        else:
            setattr(section, key, value)
    return config


def to_dict(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)

"""The models, by name. `build_model("gpt-small", n_layer=4)` starts from a preset and
overrides fields of its config; every preset is a plain config dataclass below.

The models know nothing about parallelism: data, tensor and pipeline parallelism are
applied from outside, through the named submodules each model documents.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from paratrain.models.cnn import CNN, CNNConfig
from paratrain.models.gpt import GPT, GPTConfig, gpt_parameter_count
from paratrain.models.mlp import MLP, DeepMLP, DeepMLPConfig, MLPConfig

PRESETS = {
    # The ring-allreduce seed's model, sized for the teacher data set's defaults.
    "mlp": MLPConfig(in_dim=64, hidden=256, classes=10),
    # microddp's 16-layer MLP; train it on `regression` with in_dim = out_dim = width.
    "mlp16": DeepMLPConfig(width=1024, depth=16),
    # The profiling seed's CNN, sized for the 8x8 digits images.
    "cnn": CNNConfig(in_channels=1, image_size=8, channels=(32, 64, 128), hidden=512, classes=10),
    # Trains in seconds on one CPU core: what tests and demos use.
    "gpt-tiny": GPTConfig(n_layer=2, d_model=64, n_head=4, d_mlp=256, vocab_size=256, block_size=64),
    # 8 layers, as in the seed, so it splits into 4 pipeline stages of 2; heads and d_mlp
    # divide by 2 and 4 for tensor parallelism. Still small enough for a CPU.
    "gpt-small": GPTConfig(n_layer=8, d_model=128, n_head=4, d_mlp=512, vocab_size=512, block_size=64),
    # The GT seed's configuration (TP=2 x PP=4 on 8 GPUs). The seed calls it "512M"; it has
    # 204,746,752 parameters (see gpt_parameter_count).
    "gpt-seed": GPTConfig(
        n_layer=8, d_model=1024, n_head=16, d_mlp=4096, vocab_size=50257, block_size=1024
    ),
}
MODEL_NAMES = tuple(PRESETS)

_BUILDERS = {MLPConfig: MLP, DeepMLPConfig: DeepMLP, CNNConfig: CNN, GPTConfig: GPT}


def model_config(name: str, **overrides):
    """The preset config for `name` with `overrides` applied, validated."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")
    preset = PRESETS[name]
    valid = [field.name for field in dataclasses.fields(preset)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(
            f"model {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"valid: {', '.join(valid)}"
        )
    config = dataclasses.replace(preset, **overrides)
    config.validate()
    return config


def build_model(name: str, **overrides) -> nn.Module:
    """A freshly initialised model; its weights come from torch's global RNG, so seed it."""
    config = model_config(name, **overrides)
    return _BUILDERS[type(config)](config)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def format_count(n: int) -> str:
    """A count for people: 204746752 -> '204.7M'."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


__all__ = [
    "CNN", "CNNConfig", "DeepMLP", "DeepMLPConfig", "GPT", "GPTConfig", "MLP", "MLPConfig",
    "MODEL_NAMES", "PRESETS", "build_model", "count_parameters", "format_count",
    "gpt_parameter_count", "model_config",
]

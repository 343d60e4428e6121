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
from paratrain.models.llama import Llama, LlamaConfig, llama_parameter_count
from paratrain.models.mlp import MLP, DeepMLP, DeepMLPConfig, MLPConfig
from paratrain.models.moe_llama import MoEConfig, MoELlama, moe_parameter_count, moe_parameter_counts
from paratrain.models.user_model import CausalLMFile, file_model_config, is_model_file
from paratrain.models.hf_model import FAMILIES as HF_FAMILIES, HFModelConfig, hf_model_config, is_hf_name

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
    # Llama-family decoders (RMSNorm, rotary positions, SwiGLU, grouped-query attention).
    # Trains in seconds; 2 key/value heads, so tp = 2 gives each rank one of them.
    "llama-tiny": LlamaConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_mlp=192, vocab_size=256, block_size=64),
    # 8 layers, as gpt-small, for tp 2 x pp 4; byte vocabulary with room (512) like gpt-small.
    "llama-small": LlamaConfig(n_layer=8, d_model=128, n_head=8, n_kv_head=2, d_mlp=384, vocab_size=512, block_size=64),
    # TinyLlama-1.1B's shape (TinyLlama/TinyLlama-1.1B, a Llama 2 architecture): 22 layers,
    # 2048 wide, 32 query and 4 key/value heads, SwiGLU 5632, vocabulary 32000, context 2048,
    # untied: 1,100,048,384 parameters, its published count (llama_parameter_count).
    "tinyllama-1.1b": LlamaConfig(n_layer=22, d_model=2048, n_head=32, n_kv_head=4, d_mlp=5632,
                                  vocab_size=32000, block_size=2048),
    # Llamas with mixture-of-experts feed-forward layers (moe_llama.py). llama-tiny's size with 8
    # experts of width 64, 2 per token, and one shared expert: trains in seconds.
    "moe-tiny": MoEConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_mlp=192, vocab_size=256, block_size=64,
                          n_experts=8, top_k=2, d_expert=64, n_shared_experts=1),
    # llama-small's size, 16 experts of width 96 (2 per token, one shared): the activated
    # width, 3 x 96, is about llama-small's SwiGLU (384).
    "moe-small": MoEConfig(n_layer=8, d_model=128, n_head=8, n_kv_head=2, d_mlp=384, vocab_size=512, block_size=64,
                           n_experts=16, top_k=2, d_expert=96, n_shared_experts=1),
    # Mixtral-8x7B's published shape (mistralai/Mixtral-8x7B-v0.1 config): 32 layers, 4096 wide,
    # 32 query and 8 key/value heads, 8 experts of width 14336, 2 per token, softmax then
    # renormalised, no shared expert, vocabulary 32000, context 32768, rope base 1e6, untied:
    # 46.70B parameters, 12.88B active (published: 46.7B / 12.9B).
    "mixtral-8x7b": MoEConfig(n_layer=32, d_model=4096, n_head=32, n_kv_head=8, d_mlp=14336, vocab_size=32000,
                              block_size=32768, rope_theta=1e6, n_experts=8, top_k=2, d_expert=14336,
                              n_shared_experts=0, aux_loss_coef=0.02),
    # OLMoE-1B-7B-0924 (allenai config): 16 layers, 2048 wide, 16 heads (no grouping), 64 experts
    # of width 1024, 8 per token, softmax not renormalised, vocabulary 50304, context 4096,
    # untied; its QK-norm (65,536 weights in all) is left out. 6.92B parameters, 1.28B active
    # (published: 6.9B / 1.3B, rounded).
    "olmoe-1b-7b": MoEConfig(n_layer=16, d_model=2048, n_head=16, n_kv_head=16, d_mlp=1024, vocab_size=50304,
                             block_size=4096, n_experts=64, top_k=8, d_expert=1024, n_shared_experts=0,
                             renormalize=False, aux_loss_coef=0.01),
}
MODEL_NAMES = tuple(PRESETS)

_BUILDERS = {MLPConfig: MLP, DeepMLPConfig: DeepMLP, CNNConfig: CNN, GPTConfig: GPT, LlamaConfig: Llama,
             MoEConfig: MoELlama, CausalLMFile: CausalLMFile.build, HFModelConfig: HFModelConfig.build}
# Models of token ids (B, T) -> logits (B, T, V), with vocab_size and block_size: they train on
# tokens or text, and tensor/pipeline parallelism applies to them through a plan.
CAUSAL_LM_CONFIGS = (GPTConfig, LlamaConfig, MoEConfig, CausalLMFile, HFModelConfig)


def model_config(name: str, **overrides):
    """The preset config for `name` with `overrides` applied, validated; for a user's model
    (FILE.py:FUNCTION) its options, vocabulary and context length; for a transformers model
    (hf:FAMILY) its config file and fields."""
    if is_model_file(name):
        return file_model_config(name, overrides)
    if is_hf_name(name):
        return hf_model_config(name, overrides)
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}, FILE.py:FUNCTION or "
                         f"hf:FAMILY ({', '.join(HF_FAMILIES)})")
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


def is_model_name(name) -> bool:
    """A preset, a user's model (FILE.py:FUNCTION) or a transformers one (hf:FAMILY)."""
    return name in PRESETS or is_model_file(name) or is_hf_name(name)


def build_model(name: str, **overrides) -> nn.Module:
    """A freshly initialised model; its weights come from torch's global RNG, so seed it."""
    config = model_config(name, **overrides)
    return _BUILDERS[type(config)](config)


def parameter_count(config) -> int | None:
    """Parameters of the model `config` builds, computed without building it (None: unknown)."""
    counts = {GPTConfig: gpt_parameter_count, LlamaConfig: llama_parameter_count, MoEConfig: moe_parameter_count,
              HFModelConfig: HFModelConfig.parameter_count}
    return counts[type(config)](config) if type(config) in counts else None


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def format_count(n: int) -> str:
    """A count for people: 204746752 -> '204.7M'."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


__all__ = [
    "CAUSAL_LM_CONFIGS", "CNN", "CNNConfig", "CausalLMFile", "DeepMLP", "DeepMLPConfig", "GPT", "GPTConfig", "HFModelConfig", "Llama", "LlamaConfig", "MLP",
    "MLPConfig", "MODEL_NAMES", "MoEConfig", "MoELlama", "PRESETS", "build_model", "count_parameters", "format_count",
    "gpt_parameter_count", "llama_parameter_count", "is_hf_name", "is_model_file", "is_model_name", "model_config", "moe_parameter_counts",
    "parameter_count",
]

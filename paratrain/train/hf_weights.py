"""Our models as Hugging Face models: which HF tensor each of our parameters is, and the
config.json that builds the HF model holding them. Read both ways: `paratrain export --to hf`
writes through it and `--init-from` reads back through it, so each name is stated once.

    Llama      -> LlamaForCausalLM   names only: our rotary convention (rotate-half on the first
                                     and second halves of each head) is HF's, so q and k need no
                                     permutation
    GPT        -> GPT2LMHeadModel    HF's Conv1D keeps (in, out): the block matrices transposed
    MoE Llama  -> MixtralForCausalLM each expert its own (out, in) matrices, under the on-disk
                                     names every transformers version reads

A rule maps one of our parameters (a regex on its full name) to its HF name or names. A model
trained as `hf:FAMILY` has HF's names already: its format is the identity (`identity_format`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from paratrain.errors import UserError
from paratrain.models import GPTConfig, LlamaConfig, MoEConfig


class NoHfFormat(UserError, ValueError):
    """A model that has no Hugging Face counterpart it matches exactly, with why in one line."""


@dataclass(frozen=True)
class Rule:
    ours: str  # our parameter's full name, as a regex (groups used by `hf`)
    hf: str | None  # its HF name (re.sub template; `{e}` numbers the experts); None: HF has no such tensor
    transpose: bool = False  # HF keeps the matrix as (in, out)
    per_expert: bool = False  # ours stacks the experts on dim 0; HF names each one


@dataclass(frozen=True)
class HfFormat:
    """How one model is written as a Hugging Face model."""

    rules: tuple[Rule, ...]
    config: dict  # config.json
    experts: int = 0  # n_experts, for per-expert rules
    absent: dict = field(default_factory=dict)  # rule-less tensors HF lacks: our name -> why it must be zero

    def rule(self, ours: str) -> tuple[Rule, str | None]:
        for rule in self.rules:
            match = re.fullmatch(rule.ours, ours)
            if match:
                return rule, None if rule.hf is None else match.expand(rule.hf)
        raise NoHfFormat(f"{ours} has no Hugging Face name in the {self.config['architectures'][0]} mapping")

    def hf_names(self, ours: str) -> list[str]:
        """The HF tensors `ours` is written as (none for a tensor HF does not have)."""
        rule, name = self.rule(ours)
        if name is None:
            return []
        return [name.replace("{e}", str(e)) for e in range(self.experts)] if rule.per_expert else [name]

    def to_hf(self, ours: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        rule, _ = self.rule(ours)
        names = self.hf_names(ours)
        parts = list(tensor.unbind(0)) if rule.per_expert else [tensor]
        return {name: (part.t() if rule.transpose else part).contiguous() for name, part in zip(names, parts)}

    def from_hf(self, ours: str, tensors: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Our tensor from the HF tensors `hf_names(ours)` names (zeros shaped as `like`, which
        may be on the meta device, for one HF does not have)."""
        rule, _ = self.rule(ours)
        names = self.hf_names(ours)
        if not names:
            return torch.zeros(like.shape, dtype=like.dtype)
        parts = [tensors[name].t() if rule.transpose else tensors[name] for name in names]
        return torch.stack(parts) if rule.per_expert else parts[0]


# ---- the families ---------------------------------------------------------------------------------

_LLAMA_RULES = (
    Rule(r"tok_emb\.weight", "model.embed_tokens.weight"),
    Rule(r"layers\.(\d+)\.attn\.w([qkvo])\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    Rule(r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    Rule(r"layers\.(\d+)\.mlp_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    Rule(r"layers\.(\d+)\.mlp\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    Rule(r"layers\.(\d+)\.mlp\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    Rule(r"layers\.(\d+)\.mlp\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    Rule(r"norm\.weight", "model.norm.weight"),
    Rule(r"output\.weight", "lm_head.weight"),
)

_MIXTRAL_RULES = (
    Rule(r"layers\.(\d+)\.mlp\.router\.gate\.weight", r"model.layers.\1.block_sparse_moe.gate.weight"),
    Rule(r"layers\.(\d+)\.mlp\.router\.expert_bias", None),  # the aux-loss-free bias: refused unless zero
    *(Rule(rf"layers\.(\d+)\.mlp\.experts\.{w}", rf"model.layers.\1.block_sparse_moe.experts.{{e}}.{w}.weight",
           transpose=True, per_expert=True) for w in ("w1", "w2", "w3")),
    *_LLAMA_RULES,
)

_GPT2_RULES = (
    Rule(r"tok_emb\.weight", "transformer.wte.weight"),
    Rule(r"pos_emb\.weight", "transformer.wpe.weight"),
    Rule(r"blocks\.(\d+)\.ln([12])\.(weight|bias)", r"transformer.h.\1.ln_\2.\3"),
    Rule(r"blocks\.(\d+)\.attn\.qkv\.weight", r"transformer.h.\1.attn.c_attn.weight", transpose=True),
    Rule(r"blocks\.(\d+)\.attn\.qkv\.bias", r"transformer.h.\1.attn.c_attn.bias"),
    Rule(r"blocks\.(\d+)\.attn\.proj\.weight", r"transformer.h.\1.attn.c_proj.weight", transpose=True),
    Rule(r"blocks\.(\d+)\.attn\.proj\.bias", r"transformer.h.\1.attn.c_proj.bias"),
    Rule(r"blocks\.(\d+)\.mlp\.up\.weight", r"transformer.h.\1.mlp.c_fc.weight", transpose=True),
    Rule(r"blocks\.(\d+)\.mlp\.up\.bias", r"transformer.h.\1.mlp.c_fc.bias"),
    Rule(r"blocks\.(\d+)\.mlp\.down\.weight", r"transformer.h.\1.mlp.c_proj.weight", transpose=True),
    Rule(r"blocks\.(\d+)\.mlp\.down\.bias", r"transformer.h.\1.mlp.c_proj.bias"),
    Rule(r"ln_f\.(weight|bias)", r"transformer.ln_f.\1"),
    Rule(r"head\.weight", "lm_head.weight"),
)


def _llama_config(shape: LlamaConfig | MoEConfig, architecture: str = "LlamaForCausalLM", model_type: str = "llama") -> dict:
    return {
        "architectures": [architecture], "model_type": model_type, "torch_dtype": "float32",
        "hidden_size": shape.d_model, "intermediate_size": shape.d_mlp, "num_attention_heads": shape.n_head,
        "num_key_value_heads": shape.n_kv_head, "head_dim": shape.d_model // shape.n_head,
        "num_hidden_layers": shape.n_layer, "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.block_size, "rms_norm_eps": shape.norm_eps,
        # rope_theta for transformers 4, rope_parameters for 5 (which reads either)
        "rope_theta": shape.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "tie_word_embeddings": shape.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "attention_dropout": 0.0,
    }


def llama_format(shape: LlamaConfig) -> HfFormat:
    return HfFormat(_LLAMA_RULES, _llama_config(shape))


def gpt2_format(shape: GPTConfig) -> HfFormat:
    """GPT-2 with our GPT's choices: exact GELU (HF's "gelu", not GPT-2's tanh "gelu_new"),
    nn.LayerNorm's eps, an untied head."""
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "torch_dtype": "float32",
        "vocab_size": shape.vocab_size, "n_positions": shape.block_size, "n_embd": shape.d_model,
        "n_layer": shape.n_layer, "n_head": shape.n_head, "n_inner": shape.d_mlp, "activation_function": "gelu",
        "layer_norm_epsilon": 1e-5, "resid_pdrop": shape.dropout, "embd_pdrop": shape.dropout,
        "attn_pdrop": shape.dropout, "scale_attn_weights": True, "tie_word_embeddings": False,
    }
    return HfFormat(_GPT2_RULES, config)


def mixtral_format(shape: MoEConfig) -> HfFormat:
    """Mixtral: every layer a mixture of softmax-routed experts, the chosen weights renormalised,
    dropless, no shared expert; anything else is refused (one line each)."""
    refusals = {
        "shared experts (n_shared_experts > 0), which Mixtral does not have": shape.n_shared_experts > 0,
        "dense layers (first_dense_layers, moe_every > 1): Mixtral's are all MoE":
            len(shape.moe_layer_indices()) != shape.n_layer,
        "sigmoid routing: Mixtral's is softmax": shape.score_func != "softmax",
        "gate weights not renormalised: Mixtral renormalises them": not shape.renormalize,
        "a capacity factor: Mixtral is dropless": shape.capacity_factor is not None,
        "the aux-loss-free router bias (bias_update_rate > 0)": shape.bias_update_rate > 0,
    }
    for what, refused in refusals.items():
        if refused:
            raise NoHfFormat(f"the MoE model has {what}; it does not export as Mixtral")
    config = {**_llama_config(shape, "MixtralForCausalLM", "mixtral"), "intermediate_size": shape.d_expert,
              "num_local_experts": shape.n_experts, "num_experts_per_tok": shape.top_k,
              "router_aux_loss_coef": shape.aux_loss_coef, "router_jitter_noise": 0.0, "sliding_window": None}
    for key in ("attention_bias", "mlp_bias"):
        config.pop(key)
    return HfFormat(_MIXTRAL_RULES, config, experts=shape.n_experts)


def identity_format(hf_config: dict) -> HfFormat:
    """A model trained as hf:FAMILY: its parameters carry HF's names; its config is the run's."""
    return HfFormat((Rule(r"(.+)", r"\1"),), hf_config)


_FORMATS: dict[type, Callable] = {LlamaConfig: llama_format, GPTConfig: gpt2_format, MoEConfig: mixtral_format}


def format_for(model_name: str, shape) -> HfFormat:
    """The HF format of a model whose config is `shape`, or NoHfFormat saying why it has none."""
    hf_config = getattr(shape, "hf_config", None)  # the hook for hf:FAMILY models
    if isinstance(hf_config, dict):
        return identity_format(hf_config)
    if type(shape) not in _FORMATS:
        raise NoHfFormat(f"model {model_name!r} has no Hugging Face format (Llama, GPT and MoE Llama models have)")
    return _FORMATS[type(shape)](shape)


def model_format(model_name: str, overrides: dict) -> tuple[HfFormat, dict[str, torch.Tensor]]:
    """The HF format of a model, and the tensors a checkpoint holds of it (parameters, a tied one
    once, then persistent buffers) on the meta device, by name in the model's order."""
    from paratrain.models import model_config
    from paratrain.train.setup import meta_model, persistent_buffers

    try:
        shape = model_config(model_name, **overrides)
    except ValueError as error:
        raise NoHfFormat(f"model {model_name!r} cannot be built: {error}") from None
    fmt = format_for(model_name, shape)
    model = meta_model(model_name, overrides)
    return fmt, {**dict(model.named_parameters()), **persistent_buffers(model)}


def config_mismatch(ours: dict, theirs: dict) -> str | None:
    """The first setting of config.json `theirs` that differs from the one our model would write,
    as 'KEY is THEIRS, the model's is OURS'; None when the weights fit."""
    for key in ("model_type", "hidden_size", "n_embd", "intermediate_size", "n_inner", "num_attention_heads",
                "n_head", "num_key_value_heads", "num_hidden_layers", "n_layer", "vocab_size",
                "num_local_experts", "num_experts_per_tok", "tie_word_embeddings", "rms_norm_eps",
                "layer_norm_epsilon"):
        if key in ours and theirs.get(key, ours[key]) != ours[key]:
            return f"{key} is {theirs.get(key)!r}, the model's is {ours[key]!r}"
    if "rope_theta" in ours and _rope_theta(theirs) not in (None, ours["rope_theta"]):
        return f"rope_theta is {_rope_theta(theirs)!r}, the model's is {ours['rope_theta']!r}"
    return None


def _rope_theta(config: dict):
    return config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))

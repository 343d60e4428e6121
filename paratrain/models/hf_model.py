"""Hugging Face `transformers` causal LMs: `--model hf:FAMILY [--hf-config CONFIG.json]`.

transformers builds the model itself from a config (`AutoConfig.for_model(type, **fields)`, then
`AutoModelForCausalLM.from_config`), randomly initialised from torch's global RNG, which our callers
seed (every rank draws the same weights); nothing is downloaded. CONFIG.json holds config fields (a
model's config.json will do); without it, the family's tiny default below. `model:` keys in YAML
(and --vocab-size, --block-size) override fields; block_size sets the family's context field.

How the built model is adapted to our loop, pipeline and plans is models/hf_adapters.py; its
plans are models/hf_plans.py. transformers is imported only when an `hf:` model is asked for, so
`import paratrain` never imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from paratrain.errors import UserError

PREFIX = "hf:"
INSTALL = "pip install 'paratrain[hf]'"
_TINY_DECODER = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, bos_token_id=0,
                     eos_token_id=1, pad_token_id=None, tie_word_embeddings=False)


@dataclass(frozen=True)
class Family:
    model_type: str  # transformers' name for it (AutoConfig.for_model)
    context_field: str  # the config field that bounds the context (our block_size)
    tiny: dict  # the default config: llama-tiny's shape (examples/hf/FAMILY-tiny.json says the same)
    tp_refused: str | None = None  # why tensor parallelism cannot split it; None: its plan does


FAMILIES = {
    "llama": Family("llama", "max_position_embeddings", _TINY_DECODER),
    # Full attention: a sliding window shorter than the context is refused (the adapter passes no mask).
    "mistral": Family("mistral", "max_position_embeddings", {**_TINY_DECODER, "sliding_window": None}),
    "qwen2": Family("qwen2", "max_position_embeddings", _TINY_DECODER),
    # Qwen3's default head_dim is 128, not hidden / heads: stated, for a 64-wide model.
    "qwen3": Family("qwen3", "max_position_embeddings", {**_TINY_DECODER, "head_dim": 16},
                    tp_refused="its q_norm and k_norm weights are shared by every head: under tp each rank would "
                               "compute their gradient from its own heads only; use tp 1"),
    # GPT-2 without dropout (its default is 0.1 in three places), so that runs compare exactly.
    "gpt2": Family("gpt2", "n_positions", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
                                               bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                               attn_pdrop=0.0)),
}


class HFModelError(UserError, ValueError):
    """An `hf:` model that cannot be built; one line naming the family or the file."""


def is_hf_name(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise HFModelError(f"Hugging Face models need transformers: {INSTALL}") from None
    return transformers


@dataclass
class HFModelConfig:
    name: str  # hf:FAMILY
    config_file: str | None = None  # JSON file of config fields (--hf-config); None: the family's tiny default
    fields: dict = field(default_factory=dict)  # config fields that override the file's
    vocab_size: int = 0  # read from the config
    block_size: int = 0  # the family's context field
    dropout: float = 0.0  # the largest dropout probability among the config's fields

    @property
    def family(self) -> Family:
        return FAMILIES[self.name[len(PREFIX):]]

    def hf_config_object(self):
        """transformers' config: the family's, from the file (or the tiny default) and the fields."""
        transformers = transformers_module()
        values = {**self._file_fields(), **self.fields}
        stated = values.pop("model_type", self.family.model_type)
        if stated != self.family.model_type:
            raise HFModelError(f"model {self.name}: {self.config_file} is a {stated!r} config, not "
                               f"{self.family.model_type!r}")
        defaults = transformers.AutoConfig.for_model(self.family.model_type)
        unknown = sorted(k for k in self.fields if not hasattr(defaults, k))
        if unknown:
            raise HFModelError(f"model {self.name}: transformers' {type(defaults).__name__} has no field "
                               f"{unknown[0]!r}")
        try:
            return transformers.AutoConfig.for_model(self.family.model_type, **values)
        except (ValueError, TypeError, KeyError) as error:
            raise HFModelError(f"model {self.name}: transformers refuses the config: "
                               f"{' '.join(str(error).split())}") from None

    @property
    def hf_config(self) -> dict:
        """config.json of the model: its parameters have transformers' names, shapes and layout."""
        transformers = transformers_module()
        config = self.hf_config_object()
        model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        return {**config.to_dict(), "architectures": [model_class.__name__]}

    @property
    def tp_refused(self) -> str | None:
        """Why tensor parallelism cannot split this model (None: it can, by its plan)."""
        return None if self.family.tp_refused is None else f"{self.name}: {self.family.tp_refused}"

    def _file_fields(self) -> dict:
        if self.config_file is None:
            return dict(self.family.tiny)
        path = Path(self.config_file)
        try:
            values = json.loads(path.read_text())
        except OSError as error:
            raise HFModelError(f"model {self.name}: cannot read {path}: {error.strerror or error}") from None
        except json.JSONDecodeError as error:
            raise HFModelError(f"model {self.name}: {path} is not valid JSON: {error}") from None
        if not isinstance(values, dict):
            raise HFModelError(f"model {self.name}: {path} must hold a JSON object of config fields")
        return values

    def validate(self) -> None:
        """Reads vocabulary, context and dropout from the config; refuses what the adapter cannot run."""
        config = self.hf_config_object()
        self.vocab_size = config.vocab_size
        self.block_size = getattr(config, self.family.context_field)
        window = getattr(config, "sliding_window", None)
        if isinstance(window, int) and window < self.block_size:
            raise HFModelError(f"model {self.name}: sliding_window {window} is shorter than the context "
                               f"({self.block_size}); only full causal attention is supported (set it to null)")
        self.dropout = max([value for key, value in config.to_dict().items() if isinstance(value, float)
                            and ("dropout" in key or "pdrop" in key) and not key.startswith("summary")], default=0.0)

    def build(self) -> nn.Module:
        """transformers' model from the config, its weights from torch's global RNG, adapted."""
        from paratrain.models.hf_adapters import HFDecoderLM, HFGPT2LM

        config = self.hf_config_object()
        model = transformers_module().AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        wrapper = HFGPT2LM if self.family.model_type == "gpt2" else HFDecoderLM
        return wrapper(model, self.block_size)

    def parameter_count(self) -> int:
        """Parameters of the model, a tied table once, counted on the meta device (no memory)."""
        from paratrain.models.meta import on_meta

        with on_meta():
            return sum(p.numel() for p in self.build().parameters())


def hf_model_config(name: str, overrides: dict) -> HFModelConfig:
    """The validated config of `hf:FAMILY` with `overrides` (hf_config: the JSON file; vocab_size,
    block_size; any other key a field of transformers' config)."""
    family = name[len(PREFIX):]
    if family not in FAMILIES:
        raise HFModelError(f"unknown Hugging Face family {family!r} in {name!r}; valid: "
                           f"{', '.join(PREFIX + f for f in FAMILIES)}")
    fields = dict(overrides)
    path = fields.pop("hf_config", None)
    if "block_size" in fields:
        fields[FAMILIES[family].context_field] = fields.pop("block_size")
    config = HFModelConfig(name, None if path is None else str(path), fields)
    key = (name, path, _mtime(path), repr(sorted(fields.items())))
    if key not in _VALIDATED:  # validation asks for the config many times; building one takes ms
        config.validate()
        _VALIDATED[key] = (config.vocab_size, config.block_size, config.dropout)
    config.vocab_size, config.block_size, config.dropout = _VALIDATED[key]
    return config


def _mtime(path) -> float | None:
    return Path(path).stat().st_mtime if path is not None and Path(path).is_file() else None


# (name, file, its mtime, fields) -> (vocabulary, context, dropout) of a config that validated.
_VALIDATED: dict[tuple, tuple[int, int, float]] = {}

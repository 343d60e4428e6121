"""Build what a run trains: the model (identically on every rank) and its data set."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from paratrain.data import build_dataset
from paratrain.data.text import is_text_name, text_path_of
from paratrain.data.token_file import is_token_file_name, token_file_options
from paratrain.data.user_data import is_data_file
from paratrain.models import CAUSAL_LM_CONFIGS, CNNConfig, DeepMLPConfig, MLPConfig, build_model, model_config
from paratrain.models.meta import on_meta
from paratrain.models.plans import default_plan
from paratrain.models.user_model import load_function
from paratrain.parallel.plan import Plan, load_plan

# torch's default RNG is one per process, but the threads launcher runs many ranks in one
# process: model initialisation is serialised so each rank draws exactly the seed's weights.
_INIT_LOCK = threading.Lock()


@contextmanager
def seeded(seed: int):
    """Run the block with torch's RNG seeded, leaving the caller's RNG state as it was."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def meta_model(name: str, overrides: dict) -> torch.nn.Module:
    """Model `name` with `overrides`, built on the meta device without initialising it."""
    with on_meta():
        return build_model(name, **overrides)


def build_seeded_model(name: str, overrides: dict, seed: int) -> torch.nn.Module:
    with seeded(seed):
        return build_model(name, **overrides)


def plan_for(plan_path: str | None, model: torch.nn.Module) -> Plan | None:
    """The plan the run applies: the one given (YAML), else the model's own (None: it has none)."""
    if plan_path:
        return load_plan(plan_path)
    own = default_plan(model)
    return None if own is None else load_plan(own)


def dataset_for(model_name: str, overrides: dict, data_name: str | None, seed: int, loss: str | None = None):
    """The data set a model is made for, shaped to fit it (or the one named, if given), with
    the loss `loss` names (FILE.py:FUNCTION) instead of its own."""
    name, options = data_choice(model_name, overrides, data_name)
    dataset = build_dataset(name, seed, **options)
    if loss is not None:
        dataset.loss = load_function(loss, "loss")  # (outputs, targets) -> the batch's mean loss
    return dataset


def data_choice(model_name: str, overrides: dict, data_name: str | None) -> tuple[str, dict]:
    """(data set name, its options) for a model: the data it is made for, or byte-level text
    ('text' or 'text:PATH') for a GPT. Raises ValueError, in one line, for any other pairing."""
    config = model_config(model_name, **overrides)
    if isinstance(config, MLPConfig):
        natural, options = "teacher", {"in_dim": config.in_dim, "classes": config.classes}
    elif isinstance(config, DeepMLPConfig):
        natural, options = "regression", {"in_dim": config.width}
    elif isinstance(config, CNNConfig):
        natural, options = "digits", {}
    elif isinstance(config, CAUSAL_LM_CONFIGS):
        natural, options = "tokens", {"vocab_size": config.vocab_size, "block_size": config.block_size}
    else:
        raise ValueError(f"no data set known for model {model_name!r}")
    if data_name is None or data_name == natural:
        return natural, options
    if is_data_file(data_name):  # the user's own: any model, their items' shapes
        return "user", {"spec": data_name}
    if not is_text_name(data_name) and not is_token_file_name(data_name):
        also = (" or on text ('text' or 'text:PATH') or a token file ('tokens:PATH')"
                if isinstance(config, CAUSAL_LM_CONFIGS) else "")
        raise ValueError(f"model {model_name!r} trains on '{natural}' data{also}, not {data_name!r}")
    if not isinstance(config, CAUSAL_LM_CONFIGS):
        raise ValueError(f"model {model_name!r} cannot train on {data_name.partition(':')[0]}: text and token "
                         f"files are for the language models (GPT, Llama, FILE.py:FUNCTION), which predict the "
                         f"next token")
    shape = {"block_size": config.block_size, "vocab_size": config.vocab_size}
    if is_token_file_name(data_name):
        return "token_file", {**token_file_options(data_name), **shape}
    return "text", {"path": text_path_of(data_name), **shape}


def fsdp_units_note(config) -> list[str]:
    """The one line a sharded run prints when FSDP finds no blocks in the model (it is then one
    unit); nothing when it does. Reads the model built on the meta device."""
    from paratrain.parallel.data.fsdp_units import unit_layout

    model = meta_model(config.model.name, config.model.overrides)
    note = unit_layout(model, plan_for(config.model.plan, model)).note
    return [note] if note else []


def persistent_buffers(model: nn.Module, local: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The model's persistent buffers (a router's balancing bias) by name, copies; with `local`,
    only those of the modules it runs."""
    mine = {id(m) for m in (local or model).modules()}
    return {(f"{prefix}.{name}" if prefix else name): buffer.detach().clone()
            for prefix, module in model.named_modules() if id(module) in mine
            for name, buffer in module.named_buffers(recurse=False) if name not in module._non_persistent_buffers_set}

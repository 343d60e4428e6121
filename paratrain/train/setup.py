"""Build what a run trains: the model (identically on every rank) and its data set."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from paratrain.data import build_dataset
from paratrain.models import CNNConfig, DeepMLPConfig, GPTConfig, MLPConfig, build_model, model_config

# torch's default RNG is one per process, but the threads launcher runs many ranks in one
# process: model initialisation is serialised so each rank draws exactly the seed's weights.
_INIT_LOCK = threading.Lock()


@contextmanager
def seeded(seed: int):
    """Run the block with torch's RNG seeded, leaving the caller's RNG state as it was."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_seeded_model(name: str, overrides: dict, seed: int) -> torch.nn.Module:
    with seeded(seed):
        return build_model(name, **overrides)


def dataset_for(model_name: str, overrides: dict, data_name: str | None, seed: int):
    """The data set a model is made for, shaped to fit it (or the one named, if given)."""
    config = model_config(model_name, **overrides)
    if isinstance(config, MLPConfig):
        natural, options = "teacher", {"in_dim": config.in_dim, "classes": config.classes}
    elif isinstance(config, DeepMLPConfig):
        natural, options = "regression", {"in_dim": config.width}
    elif isinstance(config, CNNConfig):
        natural, options = "digits", {}
    elif isinstance(config, GPTConfig):
        natural, options = "tokens", {"vocab_size": config.vocab_size, "block_size": config.block_size}
    else:
        raise ValueError(f"no data set known for model {model_name!r}")
    if data_name is not None and data_name != natural:
        raise ValueError(f"model {model_name!r} trains on '{natural}' data, not {data_name!r}")
    return build_dataset(natural, seed, **options)

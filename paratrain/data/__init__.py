"""Data sets, by name, all with one interface:

    dataset = build_dataset("tokens", seed=0, vocab_size=512)
    inputs, targets = dataset.global_batch(step, batch_size)   # the whole world's batch
    inputs, targets = shard((inputs, targets), rank, world_size)  # this rank's part
    loss = dataset.loss(model(inputs), targets)

Every rank draws the same global batch and keeps its own slice, so what is trained on
depends only on (seed, step, batch size), never on how many ranks share it: a run on any
world size sees exactly the data of the single-process reference.

    batches = validation_batches(dataset, batch_size, max_batches)   # held-out global batches
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from paratrain.data.digits import DigitsConfig, DigitsDataset
from paratrain.data.synthetic import (
    RegressionConfig,
    RegressionDataset,
    TeacherConfig,
    TeacherDataset,
)
from paratrain.data.text import TextConfig, TextDataset
from paratrain.data.token_file import TokenFileConfig, TokenFileDataset
from paratrain.data.tokens import TokenDataset, TokensConfig
from paratrain.data.user_data import UserDataConfig, UserDataset


class Dataset(Protocol):
    name: str
    # "classification" | "regression" | "language_modeling": which loss and metrics apply
    task: str
    seed: int

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...


_DATASETS = {
    "teacher": (TeacherDataset, TeacherConfig),
    "regression": (RegressionDataset, RegressionConfig),
    "tokens": (TokenDataset, TokensConfig),
    "digits": (DigitsDataset, DigitsConfig),
    "text": (TextDataset, TextConfig),
    "token_file": (TokenFileDataset, TokenFileConfig),
    "user": (UserDataset, UserDataConfig),  # --data FILE.py:FUNCTION
}
DATASET_NAMES = tuple(_DATASETS)


# Data sets drawn from a task without end (teacher, regression, tokens) have no held-out split:
# their validation batches are fresh draws at steps no run reaches, unseen but from the same task.
HELD_OUT_STEP = 2**40


def build_dataset(name: str, seed: int, **options) -> Dataset:
    config = dataset_config(name, **options)
    dataset_cls, _ = _DATASETS[name]
    return dataset_cls(seed, config)


def dataset_config(name: str, **options):
    """The named data set's config with `options` set, validated (raises ValueError): what
    building it would check, without building it."""
    if name not in _DATASETS:
        raise ValueError(f"unknown data set {name!r}; valid: {', '.join(DATASET_NAMES)}")
    _, config_cls = _DATASETS[name]
    valid = [field.name for field in dataclasses.fields(config_cls)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"data set {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"valid: {', '.join(valid)}"
        )
    config = config_cls(**options)
    config.validate()
    return config


def validation_batches(dataset: Dataset, batch_size: int, max_batches: int) -> list:
    """Held-out global batches, the same on every call: the data set's own validation split
    where it has one (text, digits), else fresh draws from its task (see HELD_OUT_STEP)."""
    if hasattr(dataset, "validation_batches"):
        return dataset.validation_batches(batch_size, max_batches)
    return [dataset.global_batch(HELD_OUT_STEP + index, batch_size) for index in range(max_batches)]


def rank_batch(dataset, step: int, batch_size: int, rank: int, world_size: int):
    """`shard(dataset.global_batch(step, batch_size), rank, world_size)`, drawing only this
    rank's rows where the data set can (`batch_rows`), so no rank pays for the others' data."""
    if hasattr(dataset, "batch_rows") and isinstance(world_size, int) and world_size > 0 \
            and isinstance(batch_size, int) and batch_size % world_size == 0 and 0 <= rank < world_size:
        rows = batch_size // world_size
        return dataset.batch_rows(step, batch_size, rank * rows, (rank + 1) * rows)
    return shard(dataset.global_batch(step, batch_size), rank, world_size)


def shard(batch, rank: int, world_size: int):
    """Rank's contiguous slice, along dim 0, of a tensor or of a tuple/list of tensors that
    share their first dimension (e.g. (inputs, targets))."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    tensors = list(batch) if isinstance(batch, (tuple, list)) else [batch]
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1:
        raise ValueError(
            f"the tensors of a batch must share their first dimension, got sizes {sorted(sizes)}"
        )
    size = sizes.pop()
    if size % world_size:
        raise ValueError(f"batch size {size} is not divisible by world_size {world_size}")
    per_rank = size // world_size
    parts = [t[rank * per_rank : (rank + 1) * per_rank] for t in tensors]
    return type(batch)(parts) if isinstance(batch, (tuple, list)) else parts[0]


__all__ = [
    "DATASET_NAMES", "HELD_OUT_STEP", "Dataset", "DigitsConfig", "DigitsDataset", "RegressionConfig",
    "RegressionDataset", "TeacherConfig", "TeacherDataset", "TextConfig", "TextDataset", "TokenDataset",
    "TokensConfig", "build_dataset", "dataset_config", "rank_batch", "shard", "validation_batches",
]

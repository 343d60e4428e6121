"""Real text for the GPT models, one byte per token: any file, read through a memory map.

The tokens are the file's bytes (vocabulary 256), so UTF-8 text of any language needs no
tokenizer and the file is never loaded into Python objects: a batch copies only its windows.
The first 90% of the bytes are for training and the last 10% (`val_fraction`) for validation;
training windows never reach into the validation bytes. Without a path, the shipped text is
used: four Shakespeare tragedies (paratrain/data/texts/README.md says where they come from).

Shape legend: B batch, T sequence position (block_size), W window (T + 1 bytes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from paratrain.data.synthetic import check_batch_request, check_positive_fields, check_seed, seeded_generator

SHIPPED_TEXT = Path(__file__).with_name("texts") / "shakespeare_tragedies.txt"
BYTE_VOCAB = 256


def is_text_name(name) -> bool:
    """'text' (the shipped text) or 'text:PATH'."""
    return isinstance(name, str) and (name == "text" or name.startswith("text:"))


def text_path_of(name: str) -> str | None:
    """The PATH of 'text:PATH'; None for plain 'text'."""
    if name == "text":
        return None
    path = name[len("text:"):]
    if not path:
        raise ValueError("data 'text:' needs a file after the colon, e.g. text:corpus.txt ('text' alone is the shipped text)")
    return path


@dataclass
class TextConfig:
    path: str | None = None  # None: the shipped Shakespeare (SHIPPED_TEXT)
    block_size: int = 64  # tokens per sequence: the model's context
    vocab_size: int = BYTE_VOCAB  # the model's vocabulary; bytes need all 256 ids
    val_fraction: float = 0.1  # the file's last tenth is held out, as nanoGPT's char-level data does

    @property
    def file(self) -> Path:
        return SHIPPED_TEXT if self.path is None else Path(self.path).expanduser()

    def validate(self) -> None:
        """Checks the file too (its size only: nothing is read), so a bad path fails before
        any rank starts."""
        check_positive_fields(self, ("block_size", "vocab_size"))
        if self.vocab_size < BYTE_VOCAB:
            raise ValueError(
                f"byte-level text needs a GPT with vocab_size >= {BYTE_VOCAB}, got {self.vocab_size}; "
                f"use a model with vocab {BYTE_VOCAB}+ (e.g. gpt-tiny, or model.vocab_size: {BYTE_VOCAB})"
            )
        if not isinstance(self.val_fraction, float) or not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"invalid TextConfig: val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if not self.file.is_file():
            raise ValueError(f"text file {self.file} does not exist (or is not a file)")
        size = os.path.getsize(self.file)
        train_bytes, val_bytes = self.split_sizes(size)
        need = self.block_size + 1
        if min(train_bytes, val_bytes) < need:
            raise ValueError(
                f"text file {self.file} is too short: {size} bytes give {train_bytes} for training and "
                f"{val_bytes} for validation (the last {self.val_fraction:.0%}), and each needs at least "
                f"block_size + 1 = {need}"
            )

    def split_sizes(self, size: int) -> tuple[int, int]:
        return split_sizes(size, self.val_fraction)

    def ids(self) -> np.ndarray:
        """The file as token ids: one per byte."""
        return np.memmap(self.file, dtype=np.uint8, mode="r")


def split_sizes(tokens: int, val_fraction: float) -> tuple[int, int]:
    """(training, validation) tokens of a stream whose last `val_fraction` is held out."""
    train = int(tokens * (1.0 - val_fraction))
    return train, tokens - train


class TextDataset:
    name = "text"
    task = "language_modeling"

    def __init__(self, seed: int, config: TextConfig):
        config.validate()
        self.seed, self.config = check_seed(seed), config
        self.vocab_size, self.block_size = config.vocab_size, config.block_size
        # One read-only map of the file, shared by every rank of a threads run; the OS pages
        # in only the windows drawn. (Its config says how the file holds ids: token_file.py.)
        data = config.ids()
        train, _ = config.split_sizes(len(data))
        self.train_data, self.val_data = data[:train], data[train:]

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """B windows of the training bytes at random starts drawn from (seed, step) alone:
        (inputs_BT, targets_BT), the targets shifted left by one byte."""
        check_batch_request(step, batch_size)
        g = seeded_generator(self.seed, "text", step)
        W = self.block_size + 1
        starts_B = torch.randint(len(self.train_data) - W + 1, (batch_size,), generator=g)
        return self._windows(self.train_data, starts_B)

    def validation_batches(self, batch_size: int, max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Up to `max_batches` full batches of the validation bytes, the same on every call:
        windows side by side from the split's start, T apart (each predicted byte once), wrapping
        round to the first window when the split holds fewer than the batches need."""
        check_batch_request(0, batch_size)
        if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
            raise ValueError(f"max_batches must be a positive integer, got {max_batches!r}")
        T = self.block_size
        windows = (len(self.val_data) - 1) // T  # validate() made sure there is at least one
        count = min(max_batches, -(-windows // batch_size))
        batches = []
        for b in range(count):
            index_B = torch.arange(b * batch_size, (b + 1) * batch_size) % windows
            batches.append(self._windows(self.val_data, index_B * T))
        return batches

    def _windows(self, data: np.ndarray, starts_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets_BW = starts_B.numpy()[:, None] + np.arange(self.block_size + 1)
        tokens_BW = torch.from_numpy(data[offsets_BW].astype(np.int64))
        return tokens_BW[:, :-1].contiguous(), tokens_BW[:, 1:].contiguous()

    def loss(self, logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1))

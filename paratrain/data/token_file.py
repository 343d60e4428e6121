"""A user's tokens: a flat binary file of token ids, as nanoGPT's prepare scripts write
(`train.bin`: numpy uint16, one id after another), read through a memory map.

`--data tokens:PATH` (uint16) or `tokens:PATH:uint32` (a vocabulary over 65,536). The file is
split as text is (text.py): the first 90% of its tokens for training, the last 10% for
validation; the windows, the batches and the loss are text's, only the width of an id differs.
Validation reads the file once, for its largest id, so that an id beyond the model's vocabulary
is one line before any rank starts rather than an index error inside the embedding on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paratrain.data.synthetic import check_positive_fields
from paratrain.data.text import TextDataset, split_sizes

WIDTHS = {"uint16": np.uint16, "uint32": np.uint32}
CHUNK_TOKENS = 1 << 24  # ids read at a time for the largest one: 32 MiB of uint16


def is_token_file_name(name) -> bool:
    """'tokens:PATH' or 'tokens:PATH:uint32' ('tokens' alone is the synthetic stream)."""
    return isinstance(name, str) and name.startswith("tokens:")


def token_file_options(name: str) -> dict:
    """{'path', 'dtype'} of 'tokens:PATH[:uint16|uint32]'."""
    rest = name[len("tokens:"):]
    path, _, dtype = rest.rpartition(":")
    if dtype not in WIDTHS:
        path, dtype = rest, "uint16"
    if not path:
        raise ValueError("data 'tokens:' needs a file after the colon, e.g. tokens:train.bin or "
                         "tokens:train.bin:uint32 ('tokens' alone is the synthetic stream)")
    return {"path": path, "dtype": dtype}


@dataclass
class TokenFileConfig:
    path: str = ""  # the file of ids
    dtype: str = "uint16"  # uint16 (nanoGPT's) or uint32
    block_size: int = 64  # tokens per sequence: the model's context
    vocab_size: int = 50304  # the model's vocabulary: every id must be below it
    val_fraction: float = 0.1  # the last tenth is held out

    @property
    def file(self) -> Path:
        return Path(self.path).expanduser()

    def validate(self) -> None:
        check_positive_fields(self, ("block_size", "vocab_size"))
        if self.dtype not in WIDTHS:
            raise ValueError(f"token file dtype {self.dtype!r}; valid: {', '.join(WIDTHS)}")
        if not isinstance(self.val_fraction, float) or not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"invalid TokenFileConfig: val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if not self.file.is_file():
            raise ValueError(f"token file {self.file} does not exist (or is not a file)")
        width = np.dtype(WIDTHS[self.dtype]).itemsize
        size = os.path.getsize(self.file)
        if size % width:
            hint = " (is it uint16? then drop ':uint32')" if size % 2 == 0 else ""
            raise ValueError(f"token file {self.file} holds {size} bytes, not a whole number of {self.dtype} ids "
                             f"({width} bytes each){hint}")
        tokens = size // width
        train, val = self.split_sizes(tokens)
        need = self.block_size + 1
        if min(train, val) < need:
            raise ValueError(f"token file {self.file} is too short: {tokens} ids give {train} for training and "
                             f"{val} for validation (the last {self.val_fraction:.0%}), and each needs at least "
                             f"block_size + 1 = {need}")
        largest, where = _largest(self.ids())
        if largest >= self.vocab_size:
            raise ValueError(f"token file {self.file}: id {largest} (token {where:,}) is beyond the model's "
                             f"vocabulary of {self.vocab_size} (ids 0 to {self.vocab_size - 1}); "
                             f"give the model a larger vocab_size")

    def split_sizes(self, tokens: int) -> tuple[int, int]:
        return split_sizes(tokens, self.val_fraction)

    def ids(self) -> np.ndarray:
        return np.memmap(self.file, dtype=WIDTHS[self.dtype], mode="r")


def _largest(ids: np.ndarray) -> tuple[int, int]:
    """(the largest id, its first position), read a chunk at a time."""
    largest, where = -1, 0
    for start in range(0, len(ids), CHUNK_TOKENS):
        chunk = ids[start:start + CHUNK_TOKENS]
        index = int(chunk.argmax())
        if int(chunk[index]) > largest:
            largest, where = int(chunk[index]), start + index
    return largest, where


class TokenFileDataset(TextDataset):
    """Text's windows over ids of any width (the config's `ids()` maps them)."""
    name = "token_file"

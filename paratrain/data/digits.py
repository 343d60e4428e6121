"""scikit-learn's bundled handwritten digits: 1,797 8x8 greyscale images of 0-9. They ship
inside the scikit-learn package, so nothing is downloaded — the one real data set we have.

Shape legend: B batch, C channels (1), S spatial side (8), N images.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from paratrain.data.synthetic import check_batch_request, check_seed, seeded_generator

_SPLIT_SEED = 0  # the train/held-out split is the same for every seed, so runs compare
_NUM_IMAGES = 1797


@dataclass
class DigitsConfig:
    held_out: int = 297  # 1/6 of the images kept aside for accuracy; 1,500 left to train on

    def validate(self) -> None:
        value = self.held_out
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _NUM_IMAGES:
            raise ValueError(
                f"invalid DigitsConfig: held_out must be in [0, {_NUM_IMAGES}), got {value!r}"
            )


@functools.lru_cache(maxsize=1)
def _load_images() -> tuple[torch.Tensor, torch.Tensor]:
    """All images as (images_NCSS float in [0, 1], labels_N long), read once per process.

    Read from the file scikit-learn ships (what its load_digits reads: 1,797 rows of 64 pixel
    values 0-16 and the label), without importing scikit-learn: that import brings SciPy, about
    2 s of CPU in every rank that trains on digits."""
    with gzip.open(_digits_path(), "rt") as text:
        rows_N65 = np.loadtxt(text, delimiter=",", dtype=np.float32)
    images_NCSS = torch.from_numpy(rows_N65[:, :-1].reshape(-1, 1, 8, 8)) / 16.0  # a new tensor
    return images_NCSS, torch.from_numpy(rows_N65[:, -1].astype(np.int64))


def _digits_path() -> str:
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the digits images ship with scikit-learn, which is not installed: "
                                  "pip install scikit-learn", name="sklearn")
    return os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")


class DigitsDataset:
    """Step k takes images k*B .. (k+1)*B - 1 of a shuffled order of the training split
    (the order fixed by the seed), wrapping around at its end."""

    name = "digits"
    task = "classification"
    num_classes = 10
    in_channels = 1
    image_size = 8

    def __init__(self, seed: int, config: DigitsConfig):
        config.validate()
        self.seed, self.config = check_seed(seed), config
        images_NCSS, labels_N = _load_images()
        split_g = seeded_generator(_SPLIT_SEED, "digits-split")
        split_N = torch.randperm(len(labels_N), generator=split_g)
        train_idx, held_idx = split_N[config.held_out:], split_N[: config.held_out]
        # One scalar mean and std from the training split (many border pixels are always 0,
        # so a per-pixel std would divide by zero): inputs come out zero-mean, unit-variance.
        mean, std = images_NCSS[train_idx].mean(), images_NCSS[train_idx].std()
        normalised_NCSS = (images_NCSS - mean) / std
        self.train_images, self.train_labels = normalised_NCSS[train_idx], labels_N[train_idx]
        self.held_out_images, self.held_out_labels = normalised_NCSS[held_idx], labels_N[held_idx]
        order_g = seeded_generator(seed, "digits-order")
        self.order_N = torch.randperm(len(train_idx), generator=order_g)
        self.input_dim = self.in_channels * self.image_size * self.image_size

    def __len__(self) -> int:
        return len(self.order_N)

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        check_batch_request(step, batch_size)
        positions_B = torch.arange(step * batch_size, (step + 1) * batch_size) % len(self.order_N)
        idx_B = self.order_N[positions_B]
        return self.train_images[idx_B], self.train_labels[idx_B]

    def held_out_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All held-out images and labels, for measuring accuracy."""
        return self.held_out_images, self.held_out_labels

    def validation_batches(self, batch_size: int, max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The held-out images in order, `batch_size` at a time (the last batch may be smaller),
        at most `max_batches` of them."""
        check_batch_request(0, batch_size)
        images_NCSS, labels_N = self.held_out_set()
        return list(zip(images_NCSS.split(batch_size), labels_N.split(batch_size)))[:max_batches]

    def loss(self, logits_BK: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits_BK, labels_B)

"""A configurable CNN, as in the DDP communication-profiling seed (`--channels 32 64 128
--hidden 512`): change the widths to change how much gradient there is to communicate.

Shape legend: B batch, C channels, S spatial side (images are square), F flattened
features, H hidden width, K classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.mlp import positive_int_problems, raise_if_invalid


@dataclass
class CNNConfig:
    in_channels: int = 1  # the digits images are greyscale
    image_size: int = 8  # the digits images are 8x8
    channels: tuple[int, ...] = (32, 64, 128)  # one conv block per entry: the seed's default
    hidden: int = 512  # the seed's default width of the classifier's hidden layer
    classes: int = 10  # ten digits

    def __post_init__(self):
        # A CLI or YAML hands over a list; a tuple keeps the config hashable and immutable.
        if isinstance(self.channels, list):
            self.channels = tuple(self.channels)

    def validate(self) -> None:
        problems = positive_int_problems(self, ("in_channels", "image_size", "hidden", "classes"))
        if not isinstance(self.channels, tuple) or not self.channels:
            problems.append(f"channels must be a non-empty sequence of ints, got {self.channels!r}")
        elif any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.channels):
            problems.append(f"channels must all be positive integers, got {self.channels!r}")
        raise_if_invalid(self, problems)


class ConvBlock(nn.Module):
    """Conv3x3 (padding 1, so the size is kept) -> ReLU -> MaxPool2d(2) when the image is
    still at least 2x2; an 8x8 input can only be halved three times, so deeper stacks keep
    their remaining blocks at 1x1 instead of failing."""

    def __init__(self, in_channels: int, out_channels: int, pool: bool):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x_BCSS: torch.Tensor) -> torch.Tensor:
        return self.pool(F.relu(self.conv(x_BCSS)))


class CNN(nn.Module):
    def __init__(self, config: CNNConfig):
        super().__init__()
        config.validate()
        self.config = config
        blocks, size, in_channels = [], config.image_size, config.in_channels
        for out_channels in config.channels:
            pool = size >= 2
            blocks.append(ConvBlock(in_channels, out_channels, pool))
            size, in_channels = (size // 2 if pool else size), out_channels
        self.blocks = nn.ModuleList(blocks)
        self.out_size = size  # spatial side after the last block
        self.fc1 = nn.Linear(in_channels * size * size, config.hidden)
        self.fc2 = nn.Linear(config.hidden, config.classes)

    def forward(self, x_BCSS: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x_BCSS = block(x_BCSS)
        x_BF = x_BCSS.flatten(1)
        h_BH = F.relu(self.fc1(x_BF))
        return self.fc2(h_BH)  # logits_BK

"""Two MLPs: the ring-allreduce seed's teacher-task classifier and microddp's 16-layer MLP.

Shape legend: B batch, I input features, H hidden width, C classes, W width (DeepMLP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MLPConfig:
    in_dim: int = 64  # the teacher data set's default input width
    hidden: int = 256  # 4x the input: wide enough to fit the teacher in a few dozen steps
    classes: int = 10  # the teacher data set's default number of labels

    def validate(self) -> None:
        raise_if_invalid(self, positive_int_problems(self, ("in_dim", "hidden", "classes")))


class MLP(nn.Module):
    """Linear -> GELU -> Linear. `fc1` then `fc2` is the column-then-row pair of tensor
    parallelism, so the two stay separate named layers."""

    def __init__(self, config: MLPConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.fc1 = nn.Linear(config.in_dim, config.hidden)
        self.fc2 = nn.Linear(config.hidden, config.classes)

    def forward(self, x_BI: torch.Tensor) -> torch.Tensor:
        h_BH = F.gelu(self.fc1(x_BI))
        return self.fc2(h_BH)  # logits_BC


@dataclass
class DeepMLPConfig:
    width: int = 1024  # microddp's width: 16 x 1024^2 weights is ~16.8M parameters, 67 MB of
    #                    fp32 gradients, enough for gradient bucketing to matter
    depth: int = 16  # microddp's layer count; also splits evenly into 2, 4, 8 or 16 stages

    def validate(self) -> None:
        raise_if_invalid(self, positive_int_problems(self, ("width", "depth")))


class DeepMLP(nn.Module):
    """`depth` Linear(width, width) layers with ReLU between them (none after the last, so
    the output can match any real-valued target). Input and output are both `width` wide,
    which is what the regression data set produces when its dims equal the width."""

    def __init__(self, config: DeepMLPConfig):
        super().__init__()
        config.validate()
        self.config = config
        # A ModuleList, not a Sequential with ReLU modules in it, so that `layers[i]` is the
        # i-th Linear: pipeline stages cut it by index, bucketing walks it in order.
        self.layers = nn.ModuleList(
            nn.Linear(config.width, config.width) for _ in range(config.depth)
        )

    def forward(self, x_BW: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x_BW = layer(x_BW)
            if i < last:
                x_BW = F.relu(x_BW)
        return x_BW


def positive_int_problems(config, names: tuple[str, ...]) -> list[str]:
    """One line per field of `config` that is not a positive int (every model config's check)."""
    problems = []
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be a positive integer, got {value!r}")
    return problems


def raise_if_invalid(config, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"invalid {type(config).__name__}: " + "; ".join(problems))

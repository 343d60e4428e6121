"""Synthetic data sets drawn from a fixed random task: teacher-labelled classification (the
ring-allreduce seed) and linear regression `y = x·w* + noise` (the profiling seed).

Also home of what every data set here shares: `seeded_generator`, which turns (seed, purpose,
step) into a torch RNG, so a batch depends on nothing but those three numbers and the batch
size — not on the world size, the rank, or what was drawn before.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def seeded_generator(seed: int, purpose: str, step: int = 0, *more: int) -> torch.Generator:
    """A CPU generator for one (seed, purpose, step[, more...]). numpy's SeedSequence hashes
    them into a well-mixed 64-bit seed, so neighbouring seeds or steps give unrelated streams;
    crc32 names the purpose stably across runs (Python's `hash` of a str is salted)."""
    entropy = [seed, zlib.crc32(purpose.encode()), step, *more]
    state = np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return seed


def check_batch_request(step, batch_size) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")


# A batch is drawn in blocks of this many rows, each from its own generator, so that any range
# of rows can be drawn alone: a rank draws only its shard, at the cost of its shard, and the
# rows are the same whoever draws them (the batch depends only on seed, step and batch size).
ROWS_PER_BLOCK = 64


def draw_rows(seed: int, step: int, batch_size: int, start: int, stop: int, draw_block) -> tuple:
    """Rows [start, stop) of step's batch. `draw_block(generator, n)` returns a tuple of
    tensors of n rows: the rows of one block, drawn from that block's generator."""
    if not 0 <= start < stop <= batch_size:
        raise ValueError(f"rows [{start}, {stop}) are not inside a batch of {batch_size}")
    parts = []
    for block in range(start // ROWS_PER_BLOCK, (stop - 1) // ROWS_PER_BLOCK + 1):
        first = block * ROWS_PER_BLOCK
        rows = min(ROWS_PER_BLOCK, batch_size - first)
        drawn = draw_block(seeded_generator(seed, "batch", step, block), rows)
        lo, hi = max(start - first, 0), min(stop - first, rows)
        parts.append(tuple(t[lo:hi] for t in drawn))
    return tuple(torch.cat(columns) if len(columns) > 1 else columns[0] for columns in zip(*parts))


def check_positive_fields(config, names: tuple[str, ...]) -> None:
    problems = [
        f"{name} must be a positive integer, got {getattr(config, name)!r}"
        for name in names
        if isinstance(getattr(config, name), bool)
        or not isinstance(getattr(config, name), int)
        or getattr(config, name) < 1
    ]
    if problems:
        raise ValueError(f"invalid {type(config).__name__}: " + "; ".join(problems))


@dataclass
class TeacherConfig:
    in_dim: int = 64  # the `mlp` preset's input width
    classes: int = 10  # the `mlp` preset's output width

    def validate(self) -> None:
        check_positive_fields(self, ("in_dim", "classes"))


class TeacherDataset:
    """x ~ N(0, I); label = argmax(x @ W_teacher) for a fixed random W_teacher (per seed).
    Linearly separable, so a small MLP can drive the loss well down."""

    name = "teacher"
    task = "classification"

    def __init__(self, seed: int, config: TeacherConfig):
        config.validate()
        self.seed, self.config = check_seed(seed), config
        self.input_dim, self.num_classes = config.in_dim, config.classes
        g = seeded_generator(seed, "teacher")
        self.teacher_IC = torch.randn(config.in_dim, config.classes, generator=g)

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch_rows(step, batch_size, 0, batch_size)

    def batch_rows(self, step: int, batch_size: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        check_batch_request(step, batch_size)

        def draw_block(g, n):
            x_BI = torch.randn(n, self.input_dim, generator=g)
            return x_BI, (x_BI @ self.teacher_IC).argmax(dim=1)

        return draw_rows(self.seed, step, batch_size, start, stop, draw_block)

    def loss(self, logits_BC: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits_BC, labels_B)


@dataclass
class RegressionConfig:
    in_dim: int = 1024  # the `mlp16` preset's width
    out_dim: int | None = None  # None: same as in_dim, which is what `mlp16` needs
    noise_std: float = 0.01  # small, so the attainable loss (noise_std^2) is near zero

    def __post_init__(self):
        if self.out_dim is None:
            self.out_dim = self.in_dim

    def validate(self) -> None:
        check_positive_fields(self, ("in_dim", "out_dim"))
        if not isinstance(self.noise_std, (int, float)) or self.noise_std < 0:
            raise ValueError(
                f"invalid RegressionConfig: noise_std must be >= 0, got {self.noise_std!r}"
            )


class RegressionDataset:
    """x ~ N(0, I); y = x @ w* + noise for a fixed random w* (per seed), scaled by
    1/sqrt(in_dim) so y has unit variance whatever the width: the MSE starts near 1."""

    name = "regression"
    task = "regression"

    def __init__(self, seed: int, config: RegressionConfig):
        config.validate()
        self.seed, self.config = check_seed(seed), config
        self.input_dim, self.output_dim = config.in_dim, config.out_dim
        g = seeded_generator(seed, "regression")
        w_IO = torch.randn(config.in_dim, config.out_dim, generator=g)
        self.w_IO = w_IO / math.sqrt(config.in_dim)

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch_rows(step, batch_size, 0, batch_size)

    def batch_rows(self, step: int, batch_size: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        check_batch_request(step, batch_size)

        def draw_block(g, n):
            x_BI = torch.randn(n, self.input_dim, generator=g)
            noise_BO = torch.randn(n, self.output_dim, generator=g) * self.config.noise_std
            return x_BI, x_BI @ self.w_IO + noise_BO

        return draw_rows(self.seed, step, batch_size, start, stop, draw_block)

    def loss(self, y_hat_BO: torch.Tensor, y_BO: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(y_hat_BO, y_BO)

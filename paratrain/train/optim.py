"""Optimizers and the learning-rate schedule: linear warm-up, then cosine decay (or constant)."""

from __future__ import annotations

import math

import torch

from paratrain.train.config import OptimConfig


def build_optimizer(config: OptimConfig, params) -> torch.optim.Optimizer:
    if config.name == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.name == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    raise ValueError(f"unknown optimizer {config.name!r}")


def lr_factor(step: int, config: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak lr at `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    span = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine


def build_scheduler(optimizer, config: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config, total_steps))

"""The single-process reference every parallel run must match: the plainest PyTorch loop, on
the whole global batch, with nothing of paratrain's parallel code in it."""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch

from paratrain.train.config import TrainConfig
from paratrain.train.optim import build_optimizer, build_scheduler
from paratrain.train.setup import build_seeded_model, dataset_for


class Reference(NamedTuple):
    losses: list[float]  # per step
    state: dict  # final parameters by name
    grad_norms: list[float]  # per step, before clipping (empty without --clip-grad-norm)


def reference_run(config: TrainConfig) -> Reference:
    model = build_seeded_model(config.model.name, config.model.overrides, config.seed)
    dataset = dataset_for(config.model.name, config.model.overrides, config.data.name, config.seed)
    optimizer = build_optimizer(config.optim, model.parameters())
    scheduler = build_scheduler(optimizer, config.optim, config.steps)
    bf16 = config.parallel.precision == "bf16"
    losses, norms = [], []
    for step in range(config.steps):
        inputs, targets = dataset.global_batch(step, config.data.global_batch)
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
            loss = dataset.loss(model(inputs), targets)
        loss.backward()
        if config.optim.clip_grad_norm:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.clip_grad_norm).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return Reference(losses, {name: p.detach().clone() for name, p in model.named_parameters()}, norms)

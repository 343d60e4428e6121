"""The single-process reference every parallel run must match: the plainest PyTorch loop, on
the whole global batch, with nothing of paratrain's parallel code in it."""

from __future__ import annotations

import re
import warnings
from typing import NamedTuple

import torch

from paratrain.models.moe import update_router_bias
from paratrain.parallel.precision import autocast
from paratrain.train.config import TrainConfig
from paratrain.train.hf_init import load_hf_into
from paratrain.train.optim import build_optimizer, build_scheduler
from paratrain.train.setup import build_seeded_model, dataset_for, persistent_buffers


class Reference(NamedTuple):
    losses: list[float]  # per step
    state: dict  # final parameters by name
    grad_norms: list[float]  # per step, before clipping (empty without --clip-grad-norm)
    skipped_steps: int = 0  # fp16: steps GradScaler skipped after an overflow


def reference_run(config: TrainConfig) -> Reference:
    model = build_seeded_model(config.model.name, config.model.overrides, config.seed)
    if config.checkpoint.init_from:
        load_hf_into(model, config.checkpoint.init_from, config)
    dataset = dataset_for(config.model.name, config.model.overrides, config.data.name, config.seed, config.data.loss)
    optimizer = build_optimizer(config.optim, model.parameters())
    scheduler = build_scheduler(optimizer, config.optim, config.steps)
    forward_context = autocast(config.parallel.precision, torch.device("cpu"))
    # fp16: PyTorch's own loss scaling, with its defaults, which ours follows (parallel/precision.py)
    scaler = torch.amp.GradScaler("cpu", init_scale=config.parallel.loss_scale, enabled=config.parallel.precision == "fp16")
    losses, norms, skipped = [], [], 0
    for step in range(config.steps):
        inputs, targets = dataset.global_batch(step, config.data.global_batch)
        with forward_context():
            loss = dataset.loss(model(inputs), targets)
        scaler.scale(loss).backward()
        if config.optim.clip_grad_norm:
            scaler.unscale_(optimizer)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.clip_grad_norm).item())
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        update_router_bias(model)  # a mixture of experts' balancing bias, from the step's counts (models/moe.py)
        skipped += scaler.is_enabled() and scaler.get_scale() < scale  # it backs off after a skipped step
        with warnings.catch_warnings():  # after a step GradScaler skipped, the schedule goes on (as ours does)
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    state.update(persistent_buffers(model))  # a router's balancing bias is trained state too
    return Reference(losses, state, norms, skipped)

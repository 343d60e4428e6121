"""The training loop one rank runs: the same on threads, processes and under torchrun.

Per optimizer step: take this rank's shard of the global batch, run forward/backward on each
micro-batch (communicating only on the last), let the data-parallel strategy finish the
gradients, step, and log. Timings split each step into compute and communication, and the
part of communication compute did not hide.
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import nullcontext

import torch
from tqdm import tqdm

from paratrain.data import shard
from paratrain.models import count_parameters
from paratrain.parallel.data import build_data_parallel
from paratrain.train.config import TrainConfig
from paratrain.train.optim import build_optimizer, build_scheduler
from paratrain.train.setup import build_seeded_model, dataset_for


def train_rank(group, config: TrainConfig, return_state: bool = False) -> dict:
    """Train on this rank; returns the log and summary (and final parameters if asked)."""
    device = group.transport.device  # cpu here; the rank's GPU under NCCL
    model = build_seeded_model(config.model.name, config.model.overrides, config.seed).to(device)
    dataset = dataset_for(config.model.name, config.model.overrides, config.data.name, config.seed)
    par = config.parallel
    dp = build_data_parallel(
        model, group, mode=par.dp_mode, algo=par.algo, naive_layout=par.naive_layout,
        bucket_mb=par.bucket_mb, first_bucket_mb=par.first_bucket_mb, compress=par.compress,
        local_sgd=par.local_sgd, zero=par.zero,
    )
    optimizer = dp.make_optimizer(lambda params: build_optimizer(config.optim, params))
    scheduler = build_scheduler(optimizer, config.optim, config.steps)
    micro_batches = par.grad_accum
    tokens_per_sample = getattr(dataset, "config", None) and getattr(dataset.config, "block_size", None)

    log = []
    progress = tqdm(
        total=config.steps, desc=f"train {config.model.name} x{group.size}", unit="step",
        disable=group.rank != 0, file=sys.stderr, dynamic_ncols=True,
    )
    for step in range(config.steps):
        started = time.perf_counter()
        inputs, targets = shard(dataset.global_batch(step, config.data.global_batch), group.rank, group.size)
        inputs, targets = inputs.to(device), targets.to(device)
        loss_sum = 0.0
        for index, (x, y) in enumerate(zip(inputs.chunk(micro_batches), targets.chunk(micro_batches))):
            last = index == micro_batches - 1
            with nullcontext() if last else dp.no_sync():
                loss = dataset.loss(dp.module(x), y) / micro_batches
                loss.backward()
            loss_sum += loss.item()
        dp.finish_gradients()
        dp.step(optimizer)
        scheduler.step()
        dp.zero_grad()
        step_ms = (time.perf_counter() - started) * 1e3
        comm_ms, exposed_ms = dp.timer.take()

        global_loss = torch.tensor([loss_sum], dtype=torch.float64)
        group.all_reduce(global_loss, "avg")  # logging only: outside the timed step
        entry = {
            "step": step, "loss": global_loss.item(), "lr": scheduler.get_last_lr()[0],
            "step_ms": step_ms, "compute_ms": step_ms - exposed_ms, "comm_ms": comm_ms,
            "exposed_comm_ms": exposed_ms,
        }
        log.append(entry)
        progress.update(1)
        progress.set_postfix(loss=f"{entry['loss']:.4f}", ms=f"{step_ms:.0f}")
        if group.rank == 0 and (step % config.log_every == 0 or step == config.steps - 1):
            progress.write(
                f"step {step:5d}  loss {entry['loss']:.5f}  {step_ms:7.1f} ms  "
                f"(comm {comm_ms:6.1f} ms, exposed {exposed_ms:6.1f} ms)"
            )
    progress.close()
    if par.local_sgd and config.steps % par.local_sgd:
        dp.average_parameters()  # end with one model, not world-size slightly different ones

    result = {"log": log, "summary": summarize(log, config, group.size, count_parameters(model), tokens_per_sample)}
    if return_state:
        result["state"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return result


def summarize(log: list[dict], config: TrainConfig, world_size: int, params: int, tokens_per_sample) -> dict:
    """Means over steps, leaving out the first (allocation, first-touch and warm-up costs)."""
    timed = log[1:] if len(log) > 1 else log
    mean = lambda key: statistics.fmean(entry[key] for entry in timed)  # noqa: E731
    step_ms = mean("step_ms")
    summary = {
        "model": config.model.name, "params": params, "world_size": world_size,
        "dp_mode": config.parallel.dp_mode, "global_batch": config.data.global_batch,
        "steps": len(log), "final_loss": log[-1]["loss"], "first_loss": log[0]["loss"],
        "step_ms": step_ms, "step_ms_stdev": statistics.pstdev(e["step_ms"] for e in timed),
        "compute_ms": mean("compute_ms"), "comm_ms": mean("comm_ms"),
        "exposed_comm_ms": mean("exposed_comm_ms"),
        "samples_per_s": config.data.global_batch / (step_ms / 1e3),
    }
    if tokens_per_sample:
        summary["tokens_per_s"] = summary["samples_per_s"] * tokens_per_sample
    return summary

"""The training loop one rank runs: the same on threads, processes and under torchrun.

Per optimizer step: take this rank's shard of the global batch, run forward/backward on each
micro-batch (communicating only on the last), let the data-parallel strategy finish the
gradients, step, and log (train/report.py). What a step runs is the prepared parallel model's
(train/api.py, the library face's object: one path for both); the loop only sets up, walks
the steps, and hands the log to the summary.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

from paratrain.data import rank_batch
from paratrain.mesh import Mesh
from paratrain.train.api import Prepared
from paratrain.train.compiled import EAGER_STEPS
from paratrain.train.config import TrainConfig, to_dict
from paratrain.train.evaluate import Evaluator
from paratrain.train.held_memory import HeldMemory
from paratrain.train.hf_init import init_from_hf
from paratrain.train.optim import build_optimizer, build_scheduler
from paratrain.train.parallel_model import build_parallel_model
from paratrain.train.profile import StepProfiler, profiled_steps
from paratrain.train.config_reference import config_yaml
from paratrain.train.metric_sinks import MetricSinks
from paratrain.train.report import Console, run_summary, step_entry, tokens_per_sample
from paratrain.train.resume import (
    checkpoint_to_resume, layout_of, restarted_anywhere, restore, save_if_due, train_state_for,
)
from paratrain.train.setup import dataset_for


def train_rank(group, config: TrainConfig, return_state: bool = False) -> dict:
    """Train on this rank; returns the log and summary (and final parameters if asked)."""
    run = start(group, config)
    console = Console(group, config, run.first_step)
    sinks = metric_sinks_for(group, config, run.dataset)
    profiler = StepProfiler(group, config.profile, profiled_steps(run.first_step, config.steps, config.profile_steps)) \
        if config.profile else None
    log = []
    for step in range(run.first_step, config.steps):
        # This rank's rows only, drawn before the clock starts: a step's time is training.
        inputs, targets = rank_batch(run.dataset, step, config.data.global_batch, run.mesh.dp.rank, run.mesh.dp.size)
        if profiler is not None:
            profiler.before(step)
        entry = run.step(step, inputs, targets)
        if run.evaluator.due(step):
            entry.update(run.job.evaluate(run.evaluator))
        log.append(entry)
        console.logged(entry)
        sinks.step(entry)
        if profiler is not None:
            console.traced(profiler.steps, profiler.after(step))
        save_started = time.perf_counter()
        console.saved(run.save_if_due(step + 1), save_started)
    console.close()
    result = run.finish(log, return_state)
    sinks.summary(result["summary"], config.steps - 1)
    sinks.close()
    return result


def metric_sinks_for(group, config: TrainConfig, dataset) -> MetricSinks:
    """Rank 0's --log targets (TensorBoard, W&B); nothing elsewhere or without --log."""
    if not config.log or group.rank != 0:
        return MetricSinks(1, None, {}, "", None)
    per_sample = tokens_per_sample(dataset)
    return MetricSinks(0, config.log, to_dict(config), config_yaml(config),
                       config.data.global_batch * per_sample if per_sample else None)


@dataclass
class Run:
    """What one rank's training holds from its start to its summary."""

    group: object
    config: TrainConfig
    dataset: object
    mesh: Mesh
    job: Prepared  # the parallel model, its strategy and the step's calls
    optimizer: object
    scheduler: object
    held: HeldMemory  # what the last step holds, sampled while it runs
    evaluator: Evaluator
    state: object  # what a checkpoint saves and restores
    first_step: int  # 0, or the step a checkpoint resumed at

    def step(self, step: int, inputs, targets) -> dict:
        """One optimizer step, timed; returns its log entry."""
        job, config = self.job, self.config
        if job.compiled is not None:
            job.compiled.use(step >= self.first_step + EAGER_STEPS)  # the first steps eager, to compare
        started = time.perf_counter()
        with self.held.watching() if step == config.steps - 1 else nullcontext():
            loss_sum = job.forward_backward(inputs, targets, global_loss=False)
            grad_norm = job.clip_grad_norm_(config.optim.clip_grad_norm) if config.optim.clip_grad_norm else None
            self.optimizer.step()  # the strategy's after-step with it; skipped after an fp16 overflow
            self.scheduler.step()
            self.optimizer.zero_grad()
        step_ms = (time.perf_counter() - started) * 1e3
        return step_entry(step, job, loss_sum, self.scheduler.get_last_lr()[0], step_ms, job.communication(),
                          grad_norm)

    def save_if_due(self, steps_done: int):
        """The checkpoint's folder when one was due after `steps_done` steps, else None."""
        group = self.group
        return save_if_due(self.config, group, self.state, self.scheduler, steps_done, layout_of(self.config, group.size))

    def finish(self, log: list[dict], return_state: bool) -> dict:
        """End the run: the strategy's last word, the summary (and the final parameters)."""
        self.job.finish()
        result = {"log": log, "summary": run_summary(log, self.config, self.group, self.job.parallel, self.held,
                                                     self.dataset)}
        if return_state:
            result["state"] = self.job.state_dict()
        self.job.close()
        self.mesh.close()
        return result


def start(group, config: TrainConfig) -> Run:
    """Build this rank's share of the parallel model, its optimizer and evaluator; resume from a
    checkpoint when asked to."""
    par = config.parallel
    device = group.transport.device  # cpu here; the rank's GPU under NCCL
    dataset = dataset_for(config.model.name, config.model.overrides, config.data.name, config.seed, config.data.loss)
    mesh = Mesh(group, group.size // par.replica_ranks, par.pp, par.tp, cp=par.cp, ep=par.ep)  # (world, 1, 1, 1): dp is the world
    parallel = build_parallel_model(config, mesh, dataset)  # the model itself when pp x tp = 1
    job = Prepared(parallel, mesh, par, device)
    optimizer = job.optimizer(lambda params: build_optimizer(config.optim, params))
    scheduler = build_scheduler(optimizer, config.optim, config.steps)
    held = HeldMemory(parallel.module, optimizer, job.compiled.layers if job.compiled else ())
    evaluator = Evaluator(config, dataset, parallel, mesh, device)
    # No rank trains before every rank holds its weights. Under the threads launcher the ranks
    # share torch's global RNG: initialisation draws from it (under a lock), and activation
    # checkpointing saves and restores it around each recompute. A replica already training
    # would rewind the RNG under a rank still initialising and give it other weights.
    group.barrier()
    state = train_state_for(parallel, mesh, job.dp, optimizer)
    resume_from = checkpoint_to_resume(config, restarted=restarted_anywhere(group, config))
    first_step = restore(resume_from, config, group, state, scheduler) if resume_from else 0
    if not resume_from and config.checkpoint.init_from:
        init_from_hf(config.checkpoint.init_from, config, state)
    if resume_from and group.rank == 0:
        print(f"resumed from {resume_from} at step {first_step}", file=sys.stderr, flush=True)
    return Run(group, config, dataset, mesh, job, optimizer, scheduler, held, evaluator, state, first_step)

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

from tqdm import tqdm

from paratrain.data import rank_batch
from paratrain.mesh import Mesh
from paratrain.parallel.data.strategy import strategy_of
from paratrain.train.config import TrainConfig
from paratrain.train.evaluate import Evaluator, format_validation
from paratrain.train.held_memory import HeldMemory, per_rank
from paratrain.train.mfu import model_flops_per_step, utilization
from paratrain.train.optim import build_optimizer, build_scheduler
from paratrain.train.api import Prepared
from paratrain.train.compiled import EAGER_STEPS, compile_summary
from paratrain.train.parallel_model import build_parallel_model
from paratrain.train.profile import StepProfiler, profiled_steps
from paratrain.train.resume import checkpoint_to_resume, layout_of, restore, save_if_due, train_state_for
from paratrain.train.setup import dataset_for


def train_rank(group, config: TrainConfig, return_state: bool = False) -> dict:
    """Train on this rank; returns the log and summary (and final parameters if asked)."""
    par = config.parallel
    device = group.transport.device  # cpu here; the rank's GPU under NCCL
    dataset = dataset_for(config.model.name, config.model.overrides, config.data.name, config.seed, config.data.loss)
    mesh = Mesh(group, group.size // (par.pp * par.tp), par.pp, par.tp)  # (world, 1, 1): dp is the world
    parallel = build_parallel_model(config, mesh, dataset)  # the model itself when pp x tp = 1
    job = Prepared(parallel, mesh, par, device)  # the library face's object: one path for both (train/api.py)
    dp = job.dp
    optimizer = job.optimizer(lambda params: build_optimizer(config.optim, params))
    scheduler = build_scheduler(optimizer, config.optim, config.steps)
    held = HeldMemory(parallel.module, optimizer, job.compiled.layers if job.compiled else ())  # sampled in the last step
    evaluator = Evaluator(config, dataset, parallel.module, parallel.loss_fn, mesh.dp, mesh, parallel, device)
    # No rank trains before every rank holds its weights. Under the threads launcher the ranks
    # share torch's global RNG: initialisation draws from it (under a lock), and activation
    # checkpointing saves and restores it around each recompute. A replica already training
    # would rewind the RNG under a rank still initialising and give it other weights.
    group.barrier()
    state = train_state_for(parallel, mesh, dp, optimizer)
    resume_from = checkpoint_to_resume(config, restarted=group.settings.launch.restart_count > 0)
    first_step = restore(resume_from, config, group, state, scheduler) if resume_from else 0
    if resume_from and group.rank == 0:
        print(f"resumed from {resume_from} at step {first_step}", file=sys.stderr, flush=True)

    log = []
    progress = tqdm(
        total=config.steps, initial=first_step, desc=f"train {config.model.name} x{group.size}", unit="step",
        # None: a bar only when stderr is a terminal; in CI and files, the plain log lines alone
        disable=None if group.rank == 0 else True, file=sys.stderr, dynamic_ncols=True,
    )
    profiler = StepProfiler(group, config.profile, profiled_steps(first_step, config.steps, config.profile_steps)) \
        if config.profile else None
    if job.compiled is not None:
        job.compiled.use(False)  # the first steps eager, to compare (train/compiled.py)
    for step in range(first_step, config.steps):
        if job.compiled is not None and step == first_step + EAGER_STEPS:
            job.compiled.use(True)
        # This rank's rows only, drawn before the clock starts: a step's time is training.
        inputs, targets = rank_batch(dataset, step, config.data.global_batch, mesh.dp.rank, mesh.dp.size)
        if profiler is not None:
            profiler.before(step)
        started = time.perf_counter()
        with held.watching() if step == config.steps - 1 else nullcontext():
            loss_sum = job.forward_backward(inputs, targets, global_loss=False)
            grad_norm = job.clip_grad_norm_(config.optim.clip_grad_norm) if config.optim.clip_grad_norm else None
            optimizer.step()  # the strategy's after-step with it; skipped after an fp16 overflow
            scheduler.step()
            optimizer.zero_grad()
        step_ms = (time.perf_counter() - started) * 1e3

        entry = step_entry(step, job, loss_sum, scheduler.get_last_lr()[0], step_ms, dp.timer.take(), grad_norm)
        if evaluator.due(step):
            entry.update(evaluator.run())
            dp.timer.take()  # FSDP's gathers for evaluation: not the next step's communication
        log.append(entry)
        progress.update(1)
        progress.set_postfix(loss=f"{entry['loss']:.4f}", ms=f"{step_ms:.0f}")
        if group.rank == 0 and (step % config.log_every == 0 or step == config.steps - 1 or "val_loss" in entry):
            progress.write(log_line(entry))
        trace = profiler.after(step) if profiler is not None else None
        if trace is not None:
            progress.write(f"profile of steps {profiler.steps.start}-{profiler.steps[-1]}: {trace} "
                           "(open it in ui.perfetto.dev)")
        save_started = time.perf_counter()
        saved = save_if_due(config, group, state, scheduler, step + 1, layout_of(config, group.size))
        if saved and group.rank == 0:
            size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
            progress.write(f"saved {saved} ({size / 2**20:.1f} MiB, {time.perf_counter() - save_started:.2f} s)")
    progress.close()
    if par.local_sgd and config.steps % par.local_sgd:
        dp.average_parameters()  # end with one model, not world-size slightly different ones

    result = {"log": log, "summary": run_summary(log, config, group, parallel, held, dataset)}
    if return_state:
        result["state"] = job.state_dict()
    job.close()
    mesh.close()
    return result


def run_summary(log: list[dict], config: TrainConfig, group, parallel, held, dataset) -> dict:
    """The run's summary: means over steps, the pipeline's bubble, eager against compiled, memory
    per rank (a collective) and, on rank 0 (whose summary is printed), model FLOPs and MFU."""
    params = sum(p.numel() for p in parallel.model.parameters())
    tokens_per_sample = getattr(dataset, "config", None) and getattr(dataset.config, "block_size", None)
    summary = summarize(log, config, group.size, params, tokens_per_sample) | parallel.pipeline_summary(log) \
        | compile_summary(log)
    summary["memory"] = per_rank({**held.measure(), "peak_bytes": held.peak_bytes}, group)
    if group.rank == 0:  # counting runs the model once on the meta device
        flops = model_flops_per_step(config.model.name, config.model.overrides, dataset, config.data.global_batch)
        summary.update(utilization(flops, summary["step_ms"], group.size, config.peak_tflops))
    return summary


def step_entry(step: int, job, loss_sum: float, lr: float, step_ms: float, comm: tuple, grad_norm) -> dict:
    """One step's log entry: the global loss (a collective, outside the step's time), its times,
    and what the run's options add (bubble, gradient norm, compiled, fp16's scale)."""
    comm_ms, exposed_ms = comm
    entry = {"step": step, "loss": job.global_loss(loss_sum), "lr": lr, "step_ms": step_ms,
             "compute_ms": step_ms - exposed_ms, "comm_ms": comm_ms, "exposed_comm_ms": exposed_ms}
    if job.bubble is not None:
        entry["bubble"] = job.bubble
    if grad_norm is not None:
        entry["grad_norm"] = grad_norm  # before clipping, as torch's clip_grad_norm_ returns it
    if job.compiled is not None:
        entry["compiled"] = job.compiled.on
    if job.scaler is not None:
        entry.update(loss_scale=job.scaler.scale, skipped=not job.finite)
    return entry


def log_line(entry: dict) -> str:
    return (f"step {entry['step']:5d}  loss {entry['loss']:.5f}  {entry['step_ms']:7.1f} ms  "
            f"(comm {entry['comm_ms']:6.1f} ms, exposed {entry['exposed_comm_ms']:6.1f} ms)"
            + (f"  bubble {entry['bubble']:.1%}" if "bubble" in entry else "")
            + (f"  grad norm {entry['grad_norm']:.4g}" if "grad_norm" in entry else "")
            + ("  skipped: fp16 overflow" if entry.get("skipped") else "") + format_validation(entry))


def summarize(log: list[dict], config: TrainConfig, world_size: int, params: int, tokens_per_sample) -> dict:
    """Means over steps, leaving out the first (allocation, first-touch and warm-up costs)."""
    timed = log[1:] if len(log) > 1 else log
    mean = lambda key: statistics.fmean(entry[key] for entry in timed)  # noqa: E731
    step_ms = mean("step_ms")
    summary = {
        "model": config.model.name, "params": params, "world_size": world_size,
        "dp_mode": strategy_of(config.parallel).name, "global_batch": config.data.global_batch,
        "steps": len(log), "final_loss": log[-1]["loss"], "first_loss": log[0]["loss"], "first_step": log[0]["step"],
        "step_ms": step_ms, "step_ms_stdev": statistics.pstdev(e["step_ms"] for e in timed),
        "compute_ms": mean("compute_ms"), "comm_ms": mean("comm_ms"),
        "exposed_comm_ms": mean("exposed_comm_ms"),
        "samples_per_s": config.data.global_batch / (step_ms / 1e3),
    }
    if tokens_per_sample:
        summary["tokens_per_s"] = summary["samples_per_s"] * tokens_per_sample
    if any("skipped" in entry for entry in log):  # fp16: steps whose gradients overflowed
        summary["skipped_steps"] = sum(entry["skipped"] for entry in log)
        summary["loss_scale"] = log[-1]["loss_scale"]
    norms = [entry["grad_norm"] for entry in log if "grad_norm" in entry]
    if norms:  # how often the clip bound: a limit that never binds changes nothing
        summary["clipped_steps"] = sum(norm > config.optim.clip_grad_norm for norm in norms)
        summary["max_grad_norm"] = max(norms)
    evaluated = [entry for entry in log if "val_loss" in entry]
    if evaluated:
        summary.update({key: evaluated[-1][key] for key in ("val_loss", "val_accuracy") if key in evaluated[-1]})
    return summary

"""What a training run says: each step's log entry and line, the progress bar, and the summary.

Timings split each step into compute and communication, and the part of communication
compute did not hide. The summary's means leave out the first step (allocation, first-touch
and warm-up costs).
"""

from __future__ import annotations

import statistics
import sys
import time

from tqdm import tqdm

from paratrain.parallel.data.strategy import strategy_of
from paratrain.train.compiled import compile_summary
from paratrain.train.config import TrainConfig
from paratrain.train.evaluate import format_validation
from paratrain.train.held_memory import per_rank
from paratrain.train.mfu import model_flops_per_step, utilization


class Console:
    """Rank 0's progress bar and log lines (the other ranks print nothing)."""

    def __init__(self, group, config: TrainConfig, first_step: int):
        self.rank, self.config = group.rank, config
        self.progress = tqdm(
            total=config.steps, initial=first_step, desc=f"train {config.model.name} x{group.size}", unit="step",
            # None: a bar only when stderr is a terminal; in CI and files, the plain log lines alone
            disable=None if group.rank == 0 else True, file=sys.stderr, dynamic_ncols=True,
        )

    def logged(self, entry: dict) -> None:
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{entry['loss']:.4f}", ms=f"{entry['step_ms']:.0f}")
        step, config = entry["step"], self.config
        if self.rank == 0 and (step % config.log_every == 0 or step == config.steps - 1 or "val_loss" in entry):
            self.progress.write(log_line(entry))

    def traced(self, steps: range, trace) -> None:
        """The profiler's joined trace, once written (rank 0)."""
        if trace is not None:
            self.progress.write(f"profile of steps {steps.start}-{steps[-1]}: {trace} (open it in ui.perfetto.dev)")

    def saved(self, saved, started: float) -> None:
        """A checkpoint written (rank 0 says where and how large), `started` at perf_counter()."""
        if saved and self.rank == 0:
            size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
            self.progress.write(f"saved {saved} ({size / 2**20:.1f} MiB, {time.perf_counter() - started:.2f} s)")

    def close(self) -> None:
        self.progress.close()


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
    load = job.expert_load()
    if load is not None:
        entry.update(load)
    return entry


def log_line(entry: dict) -> str:
    return (f"step {entry['step']:5d}  loss {entry['loss']:.5f}  {entry['step_ms']:7.1f} ms  "
            f"(comm {entry['comm_ms']:6.1f} ms, exposed {entry['exposed_comm_ms']:6.1f} ms)"
            + (f"  bubble {entry['bubble']:.1%}" if "bubble" in entry else "")
            + (f"  grad norm {entry['grad_norm']:.4g}" if "grad_norm" in entry else "")
            + (f"  experts max/mean {entry['expert_imbalance']:.2f}" if "expert_imbalance" in entry else "")
            + (f", dropped {entry['dropped_pairs']}" if entry.get("dropped_pairs") else "")
            + ("  skipped: fp16 overflow" if entry.get("skipped") else "") + format_validation(entry))


def run_summary(log: list[dict], config: TrainConfig, group, parallel, held, dataset) -> dict:
    """The run's summary: means over steps, the pipeline's bubble, eager against compiled, memory
    per rank (a collective) and, on rank 0 (whose summary is printed), model FLOPs and MFU."""
    params = sum(p.numel() for p in parallel.model.parameters())
    summary = summarize(log, config, group.size, params, tokens_per_sample(dataset)) \
        | parallel.pipeline_summary(log) | compile_summary(log)
    summary["memory"] = per_rank({**held.measure(), "peak_bytes": held.peak_bytes,
                                  "activations_bytes": held.activations.peak}, group)
    if group.rank == 0:  # counting runs the model once on the meta device
        flops = model_flops_per_step(config.model.name, config.model.overrides, dataset, config.data.global_batch)
        summary.update(utilization(flops, summary["step_ms"], group.size, config.peak_tflops))
    return summary


def tokens_per_sample(dataset) -> int | None:
    """A language model's sample is a sequence with a target per token; other tasks count
    samples only (None)."""
    if dataset.task != "language_modeling":
        return None
    _, targets = dataset.global_batch(0, 1)
    return targets[0].numel()


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
    loaded = [entry for entry in timed if "expert_imbalance" in entry]
    if loaded:  # a mixture of experts: how evenly its tokens spread
        summary.update(expert_imbalance=statistics.fmean(e["expert_imbalance"] for e in loaded),
                       ep_rank_imbalance=statistics.fmean(e["ep_rank_imbalance"] for e in loaded),
                       dropped_pairs=sum(e["dropped_pairs"] for e in log), expert_tokens=log[-1]["expert_tokens"])
    evaluated = [entry for entry in log if "val_loss" in entry]
    if evaluated:
        summary.update({key: evaluated[-1][key] for key in ("val_loss", "val_accuracy") if key in evaluated[-1]})
    return summary

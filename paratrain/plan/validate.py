"""`paratrain plan --validate`: the model's predictions against runs of `paratrain train` here.

Each configuration trains gpt-small on synthetic tokens with AdamW, ranks as processes (gloo,
one thread each, as the launcher sets), twice in the same processes:

- memory: two steps under torch's profiler, which records every allocation of torch's CPU
  allocator; the peak of the running sum is what training allocated at worst (the CPU's
  equivalent of torch.cuda.max_memory_allocated), on the rank that allocated most. The growth of
  the resident set (ru_maxrss) is recorded too: it adds the allocator's slack and gloo's buffers.
- step time: then `steps` steps without the profiler; the fastest step after the first, on rank
  0. The fastest, not the mean: this machine is shared, and other programs only ever add time.

The model assumes the cores are ours. On a shared machine they are not: the "others" column says
how many cores other programs kept busy during each run, and a run during which they kept more
than a quarter of a core busy is repeated, twice at most; the least disturbed counts. `--renice N`
starts the ranks N nice levels above normal (root only), so that other programs slow them less,
at the price of slowing those programs while the validation runs.

The predictions use the local CPU profile (hardware/cpu-2core.yaml, fitted on this machine by
`paratrain model fit`) or the profile given.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import click

from paratrain.launch import run
from paratrain.plan.cost_model import predict
from paratrain.plan.hardware import load_profile
from paratrain.plan.memory import GIB, Layout
from paratrain.plan.shapes import named_shape
from paratrain.train.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from paratrain.train.loop import train_rank
from paratrain.train.validate import validate

MODEL = "gpt-small"
GLOBAL_BATCH = 32
LOCAL_PROFILE = "cpu-2core"


@dataclass(frozen=True)
class Case:
    label: str
    layout: Layout
    microbatches: int = 1  # pipeline microbatches per step (pp > 1)


CASES = [
    Case("1 rank", Layout(micro_batch=32)),
    Case("1 rank, checkpointed", Layout(micro_batch=32, recompute="full")),
    Case("dp2 ddp", Layout(dp=2, micro_batch=16)),
    Case("dp2 zero-1", Layout(dp=2, micro_batch=16, zero=1)),
    Case("tp2", Layout(tp=2, micro_batch=32)),
    Case("tp2 sequence-parallel", Layout(tp=2, micro_batch=32, sequence_parallel=True)),
    Case("pp2 gpipe m4", Layout(pp=2, micro_batch=8, schedule="gpipe"), 4),
    Case("pp2 1f1b m4", Layout(pp=2, micro_batch=8, schedule="1f1b"), 4),
    Case("pp2 interleaved v2 m4", Layout(pp=2, micro_batch=8, schedule="interleaved-1f1b", virtual_stages=2), 4),
    Case("pp2 zb-h1 m4", Layout(pp=2, micro_batch=8, schedule="zb-h1"), 4),
    Case("dp2 x pp2 1f1b m2 (4 ranks)", Layout(dp=2, pp=2, micro_batch=8, schedule="1f1b"), 2),
    Case("tp2 x pp2 1f1b m4 (4 ranks)", Layout(tp=2, pp=2, micro_batch=8, schedule="1f1b"), 4),
]


def train_config(case: Case, steps: int, launcher: str = "processes") -> TrainConfig:
    layout = case.layout
    parallel = ParallelConfig(
        nproc=layout.gpus, launcher=launcher, dp_mode="ddp", zero=layout.zero, pp=layout.pp, tp=layout.tp,
        schedule=layout.schedule, microbatches=case.microbatches, virtual_stages=layout.virtual_stages,
        checkpoint_activations=layout.recompute == "full", sequence_parallel=layout.sequence_parallel)
    config = TrainConfig(model=ModelConfig(MODEL), data=DataConfig(global_batch=GLOBAL_BATCH),
                         optim=OptimConfig(name="adamw", lr=1e-3), parallel=parallel, steps=steps, log_every=10**6)
    validate(config, layout.gpus)
    return config


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_allocated(prof) -> int:
    """The most bytes torch's allocator held at once during a profile, over what it held at the
    start (the profile's [memory] events: +bytes per allocation, -bytes per free)."""
    held = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def measure_rank(group, config: TrainConfig) -> dict:
    """Two profiled steps for memory, then the timed steps; see the module's docstring."""
    from torch.profiler import ProfilerActivity, profile

    start = _resident_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_rank(group, replace(config, steps=2))
    allocated = peak_allocated(prof)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start  # ru_maxrss: kilobytes
    result = train_rank(group, config)
    return {"step_s": [entry["step_ms"] / 1e3 for entry in result["log"][1:]], "allocated": allocated,
            "resident_growth": grown}


@dataclass
class Measured:
    step_s: float          # fastest step after the first, rank 0
    median_step_s: float
    allocated: int         # the largest peak of any rank, bytes
    resident_growth: int   # the largest growth of any rank's resident set, bytes
    others_cores: float    # CPU cores other programs kept busy meanwhile, on average


def _machine_busy_seconds() -> float:
    """CPU seconds all programs have spent on this machine (the first line of /proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _our_seconds() -> float:
    """CPU seconds of this process and its finished children (the launcher's ranks)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@contextmanager
def raised_priority(step: int):
    """Run the block (and the processes it starts, which inherit it) `step` nice levels higher,
    if this user may; yields whether it could."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    raised = False
    if step > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, max(before - step, -20))
            raised = True
        except PermissionError:
            pass
    try:
        yield raised
    finally:
        if raised:
            os.setpriority(os.PRIO_PROCESS, 0, before)


def measure(case: Case, steps: int, launcher: str = "processes") -> Measured:
    started, busy, ours = time.perf_counter(), _machine_busy_seconds(), _our_seconds()
    results = run(measure_rank, case.layout.gpus, launcher=launcher, args=(train_config(case, steps, launcher),))
    others = (_machine_busy_seconds() - busy - (_our_seconds() - ours)) / (time.perf_counter() - started)
    steps_s = results[0]["step_s"]
    return Measured(min(steps_s), statistics.median(steps_s), max(r["allocated"] for r in results.values()),
                    max(r["resident_growth"] for r in results.values()), max(others, 0.0))


QUIET_CORES = 0.25  # other programs' load under which a run counts as undisturbed
ATTEMPTS = 3


def validation_rows(cases: list[Case], profile, steps: int, launcher: str = "processes"):
    shape = named_shape(MODEL)
    for case in cases:
        runs = [measure(case, steps, launcher)]
        while runs[-1].others_cores > QUIET_CORES and len(runs) < ATTEMPTS:
            runs.append(measure(case, steps, launcher))
        yield case, predict(shape, case.layout, profile, GLOBAL_BATCH), min(runs, key=lambda m: m.others_cores)


def run_validation(hardware: str | None, steps: int, renice: int = 0, cases: list[Case] = CASES) -> list[dict]:
    profile = load_profile(hardware or LOCAL_PROFILE)
    click.echo(f"validating {len(cases)} configurations of {MODEL}, global batch {GLOBAL_BATCH}, AdamW, "
               f"{steps} steps each (processes launcher) against profile {profile.name}")
    records = []
    with raised_priority(renice) as raised:
        click.echo(f"ranks run {renice} nice levels above other programs" if raised
                   else "ranks run at normal priority (see --renice): other programs may slow them")
        rows = list(validation_rows(cases, profile, steps))
    click.echo(f"  {'configuration':<30} {'step: predicted':>15} {'fastest':>8} {'error':>6} {'median':>7}   "
               f"{'memory: predicted':>17} {'allocated':>9} {'error':>6} {'RSS growth':>10}  {'others':>6}")
    for case, p, m in rows:
        step_error, memory_error = p.step_s / m.step_s - 1, p.memory.total / m.allocated - 1
        click.echo(f"  {case.label:<30} {p.step_s * 1e3:>12.0f} ms {m.step_s * 1e3:>5.0f} ms {step_error:>+6.0%} "
                   f"{m.median_step_s * 1e3:>4.0f} ms   {p.memory.total / 2**20:>13.0f} MiB {m.allocated / 2**20:>5.0f} MiB"
                   f" {memory_error:>+6.0%} {m.resident_growth / 2**20:>6.0f} MiB  {m.others_cores:>6.2f}")
        records.append({"configuration": case.label, "layout": p.layout.describe(), "predicted_step_s": p.step_s,
                        "measured_step_s": m.step_s, "measured_median_step_s": m.median_step_s,
                        "predicted_memory_gib": p.memory.total / GIB, "measured_memory_gib": m.allocated / GIB,
                        "resident_growth_gib": m.resident_growth / GIB, "others_cores": m.others_cores})
    within = sum(abs(r["predicted_step_s"] / r["measured_step_s"] - 1) <= 0.25 for r in records)
    within_memory = sum(abs(r["predicted_memory_gib"] / r["measured_memory_gib"] - 1) <= 0.25 for r in records)
    click.echo(f"within 25%: step time {within} of {len(records)}, memory {within_memory} of {len(records)}")
    click.echo("others: CPU cores other programs on this machine kept busy during the run (of "
               f"{os.cpu_count()}); the model assumes none")
    return records


"""`train --profile DIR`: a torch.profiler trace of chosen steps on every rank, in one file.

torch.profiler records the thread that starts it; with `profile_all_threads` (an experimental
option of its Kineto backend) it records every thread of the process: the rank threads of the
threads launcher, and each group's communication thread. Two profilers cannot run in one
process, so one runs per process, started by the process's lowest rank. Our collectives are
named ranges in it (`paratrain.all_reduce`, ...: comm/flight.py), and so is each profiled step
(`step N`).

The profiled steps start and end at a barrier, so that every rank's whole steps are in the
trace. After the last one every process writes its part; rank 0 joins them into
DIR/trace.json (Chrome's trace format: open it in ui.perfetto.dev or chrome://tracing), each
process under its own pid and each rank's thread named after it.
"""

from __future__ import annotations

import json
import os
import threading
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

TRACE_NAME = "trace.json"


def profiled_steps(first_step: int, steps: int, count: int) -> range:
    """`count` steps after the first this run takes (its allocation and warm-up are not a
    typical step), or the first when it is the only one."""
    start = first_step + 1 if steps - first_step > 1 else first_step
    return range(start, min(steps, start + count))


class StepProfiler:
    """Every rank makes the same calls at the same steps (collectives: barriers and a gather)."""

    def __init__(self, group, directory: str, steps: range):
        self.group, self.directory, self.steps = group, Path(directory), steps
        device = group.transport.device
        mine = torch.tensor([group.rank, os.getpid(), threading.get_native_id()], dtype=torch.int64, device=device)
        table = torch.empty(group.size * 3, dtype=torch.int64, device=device)
        group.all_gather(table, mine)
        self.ranks = [tuple(row) for row in table.view(-1, 3).tolist()]  # (rank, pid, thread id)
        self.owner = min(r for r, pid, _ in self.ranks if pid == os.getpid()) == group.rank
        self._profiler = None
        self._step_range = nullcontext()

    def before(self, step: int) -> None:
        if step == self.steps.start:
            self.group.barrier()
            if self.owner:
                activities = [ProfilerActivity.CPU]
                if self.group.transport.device.type == "cuda":
                    activities.append(ProfilerActivity.CUDA)
                self._profiler = profile(
                    activities=activities,
                    experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True))
                self._profiler.start()
            self.group.barrier()
        if step in self.steps:
            self._step_range = record_function(f"step {step}")
            self._step_range.__enter__()

    def after(self, step: int) -> Path | None:
        """At the last profiled step, the joined trace's path (on rank 0; None elsewhere)."""
        if step not in self.steps:
            return None
        self._step_range.__exit__(None, None, None)
        self._step_range = nullcontext()
        if step != self.steps[-1]:
            return None
        self.group.barrier()
        if self.owner:
            self._profiler.stop()
            self.directory.mkdir(parents=True, exist_ok=True)
            self._profiler.export_chrome_trace(str(self._part(os.getpid())))
            self._profiler = None
        self.group.barrier()  # every part written
        return self._join() if self.group.rank == 0 else None

    def _part(self, pid: int) -> Path:
        return self.directory / f"part-{pid}.json"

    def _join(self) -> Path:
        pids = sorted({pid for _, pid, _ in self.ranks})
        parts = [json.loads(self._part(pid).read_text()) for pid in pids]
        base_ns = parts[0].get("baseTimeNanoseconds", 0)
        names = {tid: f"rank {rank}" for rank, _, tid in self.ranks}
        events = []
        for pid, part in zip(pids, parts):
            shift_us = (part.get("baseTimeNanoseconds", 0) - base_ns) / 1e3  # one clock for all parts
            ranks = [rank for rank, p, _ in self.ranks if p == pid]
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": f"ranks {ranks}" if len(ranks) > 1 else f"rank {ranks[0]}"}})
            for event in part.get("traceEvents", []):
                if event.get("ph") == "M" and event.get("name") == "process_name":
                    continue
                if event.get("ph") == "M" and event.get("name") == "thread_name" and event.get("tid") in names:
                    event = {**event, "args": {"name": names[event["tid"]]}}
                if isinstance(event.get("ts"), (int, float)):
                    event = {**event, "ts": event["ts"] + shift_us}
                events.append(event)
        trace = self.directory / TRACE_NAME
        trace.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "baseTimeNanoseconds": base_ns,
                                     "ranks": [{"rank": r, "pid": p, "tid": t} for r, p, t in self.ranks]}))
        for pid in pids:
            self._part(pid).unlink()
        return trace

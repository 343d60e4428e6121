"""Compiled regions on a worker: runs of a client's operations as torch.compile'd functions.

A compiled region is marked in a client's stream by `region_begin` / `region_end` (a signal
with `compile: true`), or found by hot-path detection (hotpath.py, GT_AUTO_COMPILE). Inside
one, the worker holds back consecutive compilable operations (`codegen.COMPILABLE`: the pure
tensor functions of the op table) as a *run* instead of running each as it comes. Anything
else ends the run: the region's end, a collective, a send, backward, an optimizer step, a
switch of grad mode, a sync. The run executes, then that instruction runs as usual. So a
region of tensor operations runs as one function per worker, and a sharded region as one
function between each two of its collectives. Frees that arrive while a run is held wait for
its end (a result the run makes and frees is then never materialised). A run of one operation
(of fewer than GT_HOTPATH_MIN_SEQ, for a hot path) executes eagerly: there is nothing to fuse.

A run executes by its signature (`codegen.spec_of`): the first time a signature is seen, one
instruction at a time, exactly as without compilation; the second time, as a generated
function compiled with torch.compile; later runs with that signature reuse the function. A
compile that fails prints one line, the run executes eagerly, and the signature is never tried
again: the worker serves on. A run with a missing or poisoned input executes eagerly, which
reports or passes on the error as usual.

Streams without compiled regions never come here (`Executor.run_batch` hands a batch over only
from a `region_begin` on, or with auto-compile), so they run as fast as before.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from paratrain.frontend.protocol.records import CompileCounts, Timing
from paratrain.frontend.workers import codegen
from paratrain.frontend.workers.hotpath import HotPaths
from paratrain.frontend.workers.compile_settings import CompileSettings

HANDLE_BITS = 32  # as the executor keys tensors: slot << 32 | handle
MAX_FUNCTIONS = 256  # compiled functions kept; a program that makes more runs the rest eagerly
MAX_SEEN = 1 << 14  # signatures remembered after one sighting
FAILED = "failed"  # in place of a function: this signature runs eagerly from now on
# A single operation has nothing to fuse, and a compiled call costs more than its own dispatch;
# hot-path runs shorter than GT_HOTPATH_MIN_SEQ are not worth compiling either.
SHORTEST_MARKED_RUN = 2


class _Stream:
    """One client's stream while it is in a compiled region (or watched for hot paths)."""

    __slots__ = ("slot", "base", "region", "run", "frees", "hot", "complete")

    def __init__(self, slot: int, hot: HotPaths | None):
        self.slot, self.base = slot, slot << HANDLE_BITS
        self.region: str | None = None  # the marked region it is in
        self.run: list = []  # compilable instructions held back
        self.frees: list = []  # free instructions that arrived while a run was held
        self.hot = hot
        self.complete = False  # the held run is a whole hot segment

    def label(self) -> str:
        return f"region {self.region!r}" if self.region is not None else "hot path"


class Regions:
    def __init__(self, executor, settings: CompileSettings):
        self.executor, self.settings = executor, settings
        self.streams: dict[int, _Stream] = {}
        self.seen: set = set()  # signatures run once, eagerly
        self.functions: dict = {}  # signature -> compiled function, or FAILED
        self.compiled_runs = self.eager_runs = self.failures = 0
        self.configured = False
        self.said_full = False

    @property
    def counts(self) -> CompileCounts:
        made = sum(1 for function in self.functions.values() if function is not FAILED)
        return CompileCounts(made, self.compiled_runs, self.eager_runs, self.failures)

    def watching(self, slot: int) -> bool:
        return slot in self.streams or self.settings.auto

    # ---- the stream ---------------------------------------------------------------------------

    def run_batch(self, slot: int, instructions: list, frames: list, timings: list | None) -> None:
        stream = self.streams.get(slot)
        if stream is None:
            hot = HotPaths(self.settings, self._announce_hot) if self.settings.auto else None
            stream = self.streams[slot] = _Stream(slot, hot)
        for instruction in instructions:
            self._take(stream, instruction, frames, timings)
        if stream.region is None and not stream.run and stream.hot is None:
            del self.streams[slot]  # out of every region: back to the executor's own loop

    def _take(self, stream: _Stream, instruction, frames: list, timings: list | None) -> None:
        op = instruction.op
        if op == "free" and stream.run:
            stream.frees.append(instruction)
            return
        if stream.complete:  # a hot segment ended at the last operation, and its frees are in
            stream.complete = False
            self._flush(stream, timings)
        if op in codegen.COMPILABLE:
            if stream.region is not None:
                self._hold(stream, instruction, timings)
                return
            if stream.hot is not None:
                ends_before, inside, ends_after = stream.hot.see(op)
                if ends_before:
                    self._flush(stream, timings)
                if inside:
                    self._hold(stream, instruction, timings)
                    stream.complete = ends_after  # executes at the next instruction but a free
                    return
        self._flush(stream, timings)
        if op == "region_begin":
            stream.region = str(instruction.kwargs.get("name"))[:256]
        elif op == "region_end":
            stream.region = None
        self.executor.run_one(stream.slot, stream.base, instruction, frames, timings)

    def _hold(self, stream: _Stream, instruction, timings) -> None:
        if stream.run and stream.run[0].no_grad != instruction.no_grad:
            self._flush(stream, timings)  # one function, one grad mode
        stream.run.append(instruction)

    def flush(self, slot: int, timings: list | None) -> None:
        """Execute what client `slot` holds back (its sync has come)."""
        stream = self.streams.get(slot)
        if stream is not None:
            self._flush(stream, timings)

    def forget(self, slot: int) -> None:
        self.streams.pop(slot, None)

    def _flush(self, stream: _Stream, timings: list | None) -> None:
        run, frees = stream.run, stream.frees
        if not run and not frees:
            return
        stream.run, stream.frees = [], []
        if run:
            self._execute(stream, run, {handle for free in frees for handle in free.args}, timings)
        for free in frees:
            self.executor.run_one(stream.slot, stream.base, free, [], timings)

    # ---- executing a run ------------------------------------------------------------------------

    def _execute(self, stream: _Stream, run: list, freed: set, timings: list | None) -> None:
        try:
            spec, function, fresh = self._choose(stream, run, freed)
        except Exception as error:  # noqa: BLE001 - a fault in compiling costs the compilation, never the worker
            self.failures += 1
            self._warn(f"preparing {stream.label()} ({len(run)} operations) failed, running it eagerly: "
                       f"{type(error).__name__}: {str(error)[:300]}")
            spec, function, fresh = None, FAILED, False
        if function is FAILED or function is None:
            self._eagerly(stream, run, timings)
            return
        executor, base = self.executor, stream.base
        started, clock = time.time(), time.perf_counter()
        try:
            with torch.set_grad_enabled(not run[0].no_grad):
                results = function(*spec.tensors)
        except Exception as error:  # noqa: BLE001 - any failure: eager execution instead
            self.functions[spec.key] = FAILED
            self.failures += 1
            reason = (str(error).strip().splitlines() or [""])[0][:300]
            self._warn(f"could not compile {stream.label()} ({len(run)} operations), running it eagerly: "
                       f"{type(error).__name__}: {reason}")
            self._eagerly(stream, run, timings)
            return
        seconds = time.perf_counter() - clock
        self.functions[spec.key] = function
        self.compiled_runs += 1
        for handle, value in zip(spec.outputs, results):
            executor.tensors[base + handle] = value
        self._time(run, started, seconds, timings)
        if fresh:
            self._say(f"{stream.label()}: compiled {len(run)} operations ({len(spec.inputs)} inputs, "
                      f"{len(spec.outputs)} results) in {seconds:.2f} s [{codegen.digest(spec.key)}]")

    def _choose(self, stream: _Stream, run: list, freed: set) -> tuple:
        """(the run's spec, its function (None or FAILED: run it eagerly), whether the
        function is new)."""
        executor, base = self.executor, stream.base

        def lookup(handle: int):
            return None if base + handle in executor.poisoned else executor.tensors.get(base + handle)

        shortest = SHORTEST_MARKED_RUN if stream.region is not None else self.settings.min_ops
        spec = codegen.spec_of(run, freed, lookup) if len(run) >= shortest else None
        if spec is None:
            return None, None, False
        function = self.functions.get(spec.key)
        if function is not None:
            return spec, function, False
        return spec, self._new_function(stream, run, spec), True

    def _eagerly(self, stream: _Stream, run: list, timings: list | None) -> None:
        self.eager_runs += 1
        for instruction in run:
            self.executor.run_one(stream.slot, stream.base, instruction, [], timings)

    def _new_function(self, stream: _Stream, run: list, spec: codegen.RunSpec):
        """A compiled function for a signature seen before; None the first time one is seen
        (and when no more functions are kept): the run then executes eagerly."""
        if spec.key not in self.seen:
            if len(self.seen) >= MAX_SEEN:
                self.seen.clear()
            self.seen.add(spec.key)
            self._say(f"{stream.label()}: {len(run)} operations seen once, run eagerly [{codegen.digest(spec.key)}]")
            return None
        if len(self.functions) >= MAX_FUNCTIONS:
            if not self.said_full:
                self.said_full = True
                self._warn(f"{MAX_FUNCTIONS} compiled functions held; regions not seen before run eagerly")
            return None
        return self._compile(stream, run, spec)

    def _compile(self, stream: _Stream, run: list, spec: codegen.RunSpec):
        """The compiled function of a run (torch.compile compiles it at its first call)."""
        if not self.configured:
            self.configured = True
            import torch._inductor.config as inductor

            inductor.compile_threads = 1  # compile in this process: no pool of children to outlive it
        name = f"region_{codegen.digest(spec.key)}"
        text = codegen.source(run, spec, name)
        self._save(name, text, stream, len(run), spec)
        try:
            return torch.compile(codegen.function(text, name, run), dynamic=False, fullgraph=True,
                                 backend=self.settings.backend)
        except Exception as error:  # noqa: BLE001 - e.g. no compiler backend: eager execution instead
            self.functions[spec.key] = FAILED
            self.failures += 1
            self._warn(f"could not compile {stream.label()}, running it eagerly: {type(error).__name__}: "
                       f"{str(error)[:300]}")
            return FAILED

    def _time(self, run: list, started: float, seconds: float, timings: list | None) -> None:
        """Log lines for a run that executed as one call: the first instruction carries its
        time, the others none (they ran inside it)."""
        if timings is None:
            return
        for instruction in run:
            if instruction.log is not None:
                timings.append(Timing(instruction.log, started, seconds))
                seconds = 0.0

    # ---- telling ----------------------------------------------------------------------------------

    def _save(self, name: str, text: str, stream: _Stream, operations: int, spec: codegen.RunSpec) -> None:
        directory = self.settings.save_dir
        if directory is None:
            return
        shapes = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in spec.tensors)
        path = os.path.join(directory, f"{name}.py")
        try:
            os.makedirs(directory, exist_ok=True)
            with open(path, "w") as out:
                out.write(f"# paratrain worker {self.executor.rank}, client {stream.slot}, {stream.label()}: "
                          f"{operations} operations\n# inputs: {shapes}\n{text}")
        except OSError as error:
            self._warn(f"cannot save generated code to {path}: {error.strerror}")
            return
        self._say(f"{stream.label()}: generated code saved to {path}")

    def _announce_hot(self, sequence: tuple, count: int) -> None:
        self._say(f"hot path: {len(sequence)} operations seen {count} times ({' -> '.join(sequence)})")

    def _say(self, text: str) -> None:
        if self.settings.debug:
            print(f"[compile] worker {self.executor.rank}: {text}", file=sys.stderr, flush=True)

    def _warn(self, text: str) -> None:
        print(f"paratrain worker {self.executor.rank}: {text}", file=sys.stderr, flush=True)

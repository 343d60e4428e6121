"""What a worker does with instructions: run them, in order, on the tensors it holds.

Tensors are kept under a key `slot << 32 | handle`, where `slot` numbers the client (the
dispatcher assigns it) and `handle` is the number the client chose. An operation with a
function in the table (`ops.py`) runs it; the rest are found in `HANDLERS`: uploads, autograd
and optimizers (`handlers.py`), tensors crossing between workers (`crossings.py`) and the
collectives of sharded execution (`collectives.py`).

An instruction that fails records an error for its client and *poisons* its results: later
instructions that use them are skipped without a second error, and the client hears of the
first one at its next sync.

A client's stream from a `region_begin` on (every stream, with auto-compile) goes through
`Regions` (compiled.py), which runs parts of it as compiled functions; the rest of the time
instructions run here one by one, as if compilation did not exist.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import NamedTuple

import numpy
import torch

from paratrain.frontend.ops import DTYPE_NAMES, OPS
from paratrain.frontend.protocol import Instruction
from paratrain.frontend.protocol.records import ErrorReport, Fetched, Timing
from paratrain.frontend.workers import collectives, crossings, handlers
from paratrain.frontend.workers.compiled import Regions
from paratrain.frontend.workers.crossings import Links
from paratrain.frontend.workers.compile_settings import CompileSettings

HANDLE_BITS = 32
MAX_ERRORS_KEPT = 64  # per client between two syncs: the first ones explain the rest

HANDLERS = {**handlers.HANDLERS, **crossings.HANDLERS, **collectives.HANDLERS}


def _numpy_can_multiply(a, b) -> bool:
    """Two CPU tensors of one NumPy float type whose product needs no gradient."""
    return all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)
               and not (t.requires_grad and torch.is_grad_enabled()) for t in (a, b)) and a.dtype == b.dtype


class Step(NamedTuple):
    """One instruction being run: its arguments with tensors in place of handles."""
    base: int  # the client's key prefix
    instruction: Instruction
    args: list
    frames: list  # the upload frames of its batch


class Executor:
    def __init__(self, group, device: torch.device, compile_settings: CompileSettings = CompileSettings(),
                 numpy_products: bool = False, max_reply_bytes: int = 1 << 30):
        self.group = group  # None for a world of one worker
        # The dispatcher drops a frame over its limit (and the connection with it): a read whose
        # bytes would make one is refused here, in words, instead.
        self.max_reply_bytes = max_reply_bytes
        # GT's 'numpy' backend computes with NumPy. Ours computes with PyTorch on the CPU, except
        # products of tensors that need no gradient, which NumPy makes here: float32 sums in
        # another order differ in the last bits, and a program (GT's own tests) comparing our
        # products with NumPy's at a relative tolerance would fail on elements near zero.
        self.numpy_products = numpy_products
        self.groups = {}  # worker tuple -> Group, for collectives over some workers
        self.device = device
        self.rank = group.rank if group is not None else 0
        self.tensors: dict[int, object] = {}  # tensors, and optimizers under their handle
        self.poisoned: dict[int, str] = {}
        self.errors: dict[int, list] = defaultdict(list)
        self.links = Links(group, device, self.rank)
        self.regions = Regions(self, compile_settings)
        self.executed = 0
        self.by_op: Counter = Counter()  # operation name -> instructions of it run (gt.debug)

    @property
    def wait_s(self) -> float:
        """Time spent waiting for another worker's tensor (a pipeline's bubble)."""
        return self.links.wait_s

    # ---- running a batch ----------------------------------------------------------------

    def run_batch(self, slot: int, instructions: list[Instruction], frames: list, timings: list | None) -> None:
        base = slot << HANDLE_BITS
        if self.regions.watching(slot):
            self.regions.run_batch(slot, instructions, frames, timings)
        else:
            for index, instruction in enumerate(instructions):
                if instruction.op == "region_begin":  # the rest of the batch may be compiled
                    self.regions.run_batch(slot, instructions[index:], frames, timings)
                    break
                self.run_one(slot, base, instruction, frames, timings)
        self.executed += len(instructions)
        self.by_op.update([instruction.op for instruction in instructions])

    def run_one(self, slot: int, base: int, instruction: Instruction, frames: list, timings: list | None) -> None:
        """Run one instruction now (timed when the dispatcher logs it)."""
        if timings is not None and instruction.log is not None:
            started, clock = time.time(), time.perf_counter()
            self._run(slot, base, instruction, frames)
            timings.append(Timing(instruction.log, started, time.perf_counter() - clock))
        else:
            self._run(slot, base, instruction, frames)

    def _run(self, slot: int, base: int, instruction: Instruction, frames: list) -> None:
        args = list(instruction.args)
        handles = [args[i] for i in instruction.targs]
        try:
            for i, handle in zip(instruction.targs, handles):
                key = base + handle
                if key in self.poisoned:  # an earlier failure: skip quietly, pass it on
                    self._poison(base, instruction, handles, self.poisoned[key])
                    if instruction.op == "send":  # the receiving worker is waiting for a header
                        self.links.send_poisoned(instruction.kwargs["to"])
                    return
                if key not in self.tensors:
                    raise KeyError(f"handle {handle} is not a tensor on worker {self.rank}")
                args[i] = self.tensors[key]
            with torch.set_grad_enabled(not instruction.no_grad):
                self._execute(Step(base, instruction, args, frames))
        except Exception as error:  # noqa: BLE001 - reported to the client, never kills the worker
            message = f"{type(error).__name__}: {error}"
            self._record_error(slot, instruction, args, message)
            self._poison(base, instruction, handles, message)

    def _execute(self, step: Step) -> None:
        instruction = step.instruction
        op = OPS[instruction.op]
        if op.fn is None:
            HANDLERS[instruction.op](self, step)
            return
        if op.kind == "create":
            result = op.fn(*step.args, device=self.device, **instruction.kwargs)
            if instruction.requires_grad:
                result.requires_grad_(True)
        elif self.numpy_products and instruction.op == "matmul" and _numpy_can_multiply(*step.args[:2]):
            a, b = (t.detach().numpy() for t in step.args[:2])
            result = torch.from_numpy(numpy.matmul(a, b))
        else:
            result = op.fn(*step.args, **instruction.kwargs)
        if op.kind != "inplace":
            self.store(step, result)

    def store(self, step: Step, result) -> None:
        """Keep an operation's result(s) under its result handles."""
        outs = step.instruction.outs
        if isinstance(result, (tuple, list)):
            if len(result) != len(outs):
                raise RuntimeError(f"produced {len(result)} results, the client expected {len(outs)}")
            for handle, value in zip(outs, result):
                self.tensors[step.base + handle] = value
        else:
            self.tensors[step.base + outs[0]] = result

    def _poison(self, base, instruction: Instruction, handles, message) -> None:
        for handle in instruction.outs:
            self.poisoned[base + handle] = message
        if handles and OPS[instruction.op].kind == "inplace":
            self.poisoned[base + handles[0]] = message

    def _record_error(self, slot, instruction: Instruction, args, message) -> None:
        kept = self.errors[slot]
        if len(kept) < MAX_ERRORS_KEPT:
            inputs = [_describe(args[i]) for i in instruction.targs]
            kept.append(ErrorReport(instruction.seq, instruction.op, inputs, self.rank, message[:4096]))

    # ---- what the dispatcher asks outside the stream --------------------------------------

    def collect(self, slot: int, fetch: list[int]) -> tuple[list, list, list]:
        """(errors since the last sync, the fetched tensors described, their bytes); run what
        `regions` holds back for the client first (`regions.flush`)."""
        base = slot << HANDLE_BITS
        self.links.wait_sends()
        errors = self.errors.pop(slot, [])
        fetched, frames = [], []
        for handle in fetch:
            try:
                entry, frame = self._fetch(base + handle, handle)
            except Exception as error:  # noqa: BLE001 - that read fails, never the worker
                entry, frame = Fetched(handle, None, [], 0, None, f"{type(error).__name__}: {error}"[:4096]), None
            fetched.append(entry)
            if frame is not None:
                frames.append(frame)
        return errors, fetched, frames

    def _fetch(self, key: int, handle: int) -> tuple[Fetched, memoryview | bytes | None]:
        """One tensor a sync reads: (its description, its bytes), or (why not, None)."""
        if key in self.poisoned:
            return Fetched(handle, None, [], 0, None, self.poisoned[key][:4096]), None
        tensor = self.tensors.get(key)
        if not isinstance(tensor, torch.Tensor):
            return Fetched(handle, None, [], 0, None, "no such tensor on this worker"), None
        size = tensor.numel() * tensor.element_size()
        if size > self.max_reply_bytes:
            return Fetched(handle, None, [], 0, None,
                           f"it is {size / 2**20:,.1f} MiB and one message carries at most "
                           f"{self.max_reply_bytes >> 20:,} MiB: read it in slices, or raise paratrain serve "
                           f"--max-message-mb"), None
        data = tensor.detach().to("cpu").contiguous()
        return Fetched(handle, DTYPE_NAMES[data.dtype], list(data.shape), 1, None, None), _raw_bytes(data)

    def forget(self, slot: int) -> None:
        """Forget everything of a client that left."""
        self.regions.forget(slot)
        for table in (self.tensors, self.poisoned):
            for key in [k for k in table if k >> HANDLE_BITS == slot]:
                del table[key]
        self.errors.pop(slot, None)

    def memory_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in list(self.tensors.values()) if isinstance(t, torch.Tensor)
        )


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{DTYPE_NAMES.get(value.dtype, value.dtype)}{list(value.shape)}"
    return type(value).__name__


def _raw_bytes(tensor: torch.Tensor) -> memoryview | bytes:
    if tensor.numel() == 0:  # numpy cannot view every empty shape as bytes ([0, 2**63 - 1] for one)
        return b""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    if tensor.dtype == torch.bool:
        tensor = tensor.view(torch.uint8)
    return memoryview(tensor.numpy()).cast("B")

"""A client's instruction stream to one dispatcher.

Nothing waits for a worker until the program needs a value: instructions are appended to a
batch and sent when it is full or at a *sync point* (a value read with `.item()`, `.numpy()`,
`print`...). A sync asks every worker this client used to report the errors since the last sync
and the values asked for; the first error is raised here, naming the operation, its inputs, the
worker and the line of the program that issued it.

The client chooses the handles of its tensors itself, so creating a result costs no round
trip. Closing the session syncs what is still queued, so that no error goes unreported.

Where the program enters and leaves a region whose signal says `compile: true`, the session
puts a `region_begin` / `region_end` marker in the stream (the workers compile what lies
between). Which region an instruction belongs to is checked with one identity test of the
region stack, so programs without compiled regions pay nothing for them.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from paratrain.frontend import signals
from paratrain.frontend.client import autograd, regions
from paratrain.frontend.client.connection import Connection
from paratrain.frontend.client.tape import Tape
from paratrain.frontend.client.autograd import Node
from paratrain.frontend.client.dtypes import floating
from paratrain.frontend.client.tensor import Tensor
from paratrain.frontend.errors import ConnectionLost, FrontendError, RemoteError, WorkerLost
from paratrain.frontend.ops import OPS
from paratrain.frontend.protocol import Instruction, messages
from paratrain.frontend.protocol.records import Fetched
from paratrain.frontend.protocol.tensors import array_from_frame, numpy_dtype_name, part_sizes
from paratrain.frontend.shapes import infer
from paratrain.environment import Settings

BATCH_SIZE = 256  # instructions per message when nothing forces a send earlier
MAX_UNSYNCED = 16  # batches in flight before the client waits for the workers to catch up
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Session:
    def __init__(self, address: str, *, token: str | None = None, timeout: float | None = None,
                 connect_timeout: float = 60.0, name: str | None = None):
        self.address = address
        self.connection = Connection(address, token=token, timeout=timeout if timeout is not None else Settings.timeout,
                                     connect_timeout=connect_timeout, name=name)
        welcome = self.connection.welcome
        self.slot, self.n_workers, self.home = welcome.client, welcome.workers, welcome.home
        self.devices, self.logging = welcome.devices, welcome.log
        self.max_message_bytes = welcome.max_message_mb << 20
        self.placement: int | None = None  # the worker new tensors go to (None: home)
        self.signal_config: dict = {}  # what configure() last sent (signal name -> settings)
        self.worker_stats: dict = {}  # per worker, as of the last sync: busy_s, wait_s, compile (cumulative)
        self.tape = Tape()  # what this client issued (gt.debug)
        self._next_handle = 0
        self._seq = 0
        self._batch: list[Instruction] = []
        self._frames: list = []
        self._issued: dict[int, tuple] = {}  # seq -> (op, input shapes, (file, line)) until a sync
        self._unsynced = 0
        self._closed = False
        self._compiled_signals: frozenset = frozenset()  # names whose configuration says compile: true
        self._regions: tuple = ()  # the region stack as of the last instruction
        self._compiling = None  # the regions.Entry whose compiled region is open in the stream

    @property
    def closed(self) -> bool:
        return self._closed or self.connection.lost is not None

    @property
    def lost(self) -> str | None:
        """Why the dispatcher no longer serves this session (None while it does)."""
        return self.connection.lost

    @property
    def server_alive(self):
        return self.connection.server_alive

    @server_alive.setter
    def server_alive(self, check) -> None:
        self.connection.server_alive = check

    # ---- issuing ------------------------------------------------------------------------------

    def new_handle(self) -> int:
        handle = self._next_handle
        self._next_handle += 1
        return handle

    def call(self, name: str, args: list, kwargs: dict | None = None, *, requires_grad: bool = False,
             worker: int | None = None) -> list[Tensor]:
        """Issue `name(*args, **kwargs)`; -> its result tensors (a list; empty for in-place ops)."""
        self._check_open()
        kwargs = kwargs or {}
        args = [_plain(arg, self) for arg in args]
        targs = [i for i, arg in enumerate(args) if isinstance(arg, Tensor)]
        for i in targs:
            if args[i]._session is not self:
                raise ValueError(f"{name}: a tensor of another client (session) cannot be used here")
        results = infer(name, args, targs, kwargs)
        op = OPS[name]
        if requires_grad and not all(floating(dtype) for _, dtype in results):
            raise RuntimeError(f"only floating-point tensors can require gradients, {name} makes {results[0][1]}")
        grad_on = autograd.is_grad_enabled()
        parents = tuple(args[i]._graph_node() for i in targs if args[i].requires_grad) if grad_on and op.differentiable else ()
        if op.kind == "inplace":
            self._check_inplace(name, args[0], parents)
            outs = []
        else:
            outs = [Tensor(self, self.new_handle(), shape, dtype, requires_grad or bool(parents) and floating(dtype))
                    for shape, dtype in results]
            for out in outs:
                if out.requires_grad and parents:
                    out._node = Node(out, parents)
        wire_args = [arg._handle if isinstance(arg, Tensor) else arg for arg in args]
        self._append(name, [out._handle for out in outs], wire_args, targs, kwargs, [args[i] for i in targs],
                     requires_grad, worker, [(o._handle, o.shape, o.dtype, o.requires_grad) for o in outs])
        if op.kind == "inplace" and parents:
            target = args[0]
            target._requires_grad = True
            node = target._graph_node()
            node.inputs = tuple(dict.fromkeys((*node.inputs, *parents)))
        return outs

    def issue(self, name: str, outs: list[int], args: list, targs: list, kwargs: dict | None = None, *,
              tensors: tuple = (), requires_grad: bool = False, worker: int | None = None) -> None:
        """Issue an instruction whose results the caller makes itself (grad, uploads...);
        `tensors`: its tensor inputs, for error messages."""
        self._check_open()
        self._append(name, outs, args, targs, kwargs or {}, tensors, requires_grad, worker)

    def upload(self, array: np.ndarray, *, requires_grad: bool = False, worker: int | None = None) -> Tensor:
        """Queue a numpy array's bytes for a new tensor; -> the tensor."""
        array = np.ascontiguousarray(array)
        if not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        if array.nbytes > self.max_message_bytes:
            raise ValueError(
                f"a {array.nbytes / 2**20:.1f} MiB array is over the server's message limit of "
                f"{self.max_message_bytes >> 20} MiB (paratrain serve --max-message-mb); create it on the "
                "workers (gt.randn, gt.zeros...) or upload it in pieces"
            )
        dtype = numpy_dtype_name(array)
        if requires_grad and not floating(dtype):
            raise RuntimeError(f"only floating-point tensors can require gradients, this array is {dtype}")
        tensor = Tensor(self, self.new_handle(), array.shape, dtype, requires_grad)
        kwargs = {"dtype": dtype, "shape": list(array.shape), "frame": len(self._frames)}
        self._frames.append(memoryview(array).cast("B") if array.size else b"")
        self._check_open()
        self._append("upload", [tensor._handle], [], [], kwargs, (), requires_grad, worker,
                     [(tensor._handle, tensor.shape, dtype, requires_grad)])
        return tensor

    def _append(self, name, outs, args, targs, kwargs, inputs, requires_grad, worker, outputs=None) -> None:
        """Queue one instruction; `outputs` describe its results for the tape (by default only
        their handles are known here)."""
        stack = regions.stack()
        if stack is not self._regions:
            self._follow_regions()
        self._seq += 1
        self.tape.record(self._seq, name, [args[i] for i in targs],
                         outputs if outputs is not None else [(h, None, None, requires_grad) for h in outs],
                         worker if worker is not None else self.placement)
        self._issued[self._seq] = (name, [_describe(t) for t in inputs], _caller())
        self._batch.append(Instruction(self._seq, name, outs, args, targs, kwargs, not autograd.is_grad_enabled(),
                                       requires_grad, worker if worker is not None else self.placement,
                                       stack[-1].name if stack else None))
        if len(self._batch) >= BATCH_SIZE:
            self.flush()

    def _follow_regions(self) -> None:
        """The program entered or left a region: mark where a compiled region ends or begins.
        The outermost compiled region is the one marked (it runs as one; those inside it are
        part of it)."""
        self._regions = stack = regions.stack()
        entry = next((e for e in stack if e.name in self._compiled_signals), None)
        if entry is self._compiling:
            return
        if self._compiling is not None:
            self._mark("region_end", self._compiling.name)
        if entry is not None:
            self._mark("region_begin", entry.name)
        self._compiling = entry

    def _mark(self, op: str, name: str) -> None:
        self._seq += 1
        self._issued[self._seq] = (op, [], _caller())
        self._batch.append(Instruction(self._seq, op, [], [], [], {"name": name}, signal=name))

    def _check_inplace(self, name, target, parents) -> None:
        if autograd.is_grad_enabled() and target.requires_grad and target.is_leaf:
            raise RuntimeError(
                f"{name}: a leaf tensor that requires grad is being used in an in-place operation "
                "(wrap parameter updates in `with gt.no_grad():`)"
            )

    def free(self, handle: int) -> None:
        """Called when a tensor is garbage: the free goes into the stream where the program
        dropped it, so the worker reuses that memory at once (as PyTorch's allocator would)."""
        if self.closed:
            return
        batch = self._batch
        if batch and batch[-1].op == "free":
            batch[-1].args.append(handle)
        else:
            batch.append(Instruction(0, "free", [], [handle], [], {}))

    # ---- sending and syncing --------------------------------------------------------------

    def flush(self) -> None:
        """Send what is queued without waiting for it."""
        if not self._batch:
            return
        self._send(None, [])
        self._unsynced += 1
        if self._unsynced >= MAX_UNSYNCED:
            self.sync()

    def sync(self, fetch: list[int] = ()) -> list[np.ndarray]:
        """Wait until the workers ran everything issued so far; -> the fetched tensors' values."""
        self._check_open()
        if regions.stack() is not self._regions:
            self._follow_regions()  # a region left just before the sync ends before it
        self._seq += 1
        token = self._seq
        self._send(token, list(fetch))
        self._unsynced = 0
        reply = self._await(messages.Synced, lambda reply: reply.token == token)
        issued, self._issued = self._issued, {}
        if reply.errors:
            raise self._remote_error(reply.errors, issued)
        self.worker_stats = {times.worker: {"busy_s": times.busy_s, "wait_s": times.wait_s,
                                            "compile": times.compiled._asdict()} for times in reply.stats}
        values, frames = [], iter(reply.frames)
        for entry in reply.fetched:
            if entry.dtype is None:
                raise FrontendError(f"cannot read tensor h{entry.handle}: {entry.error}")
            values.append(_assemble(frames, entry))
        return values

    def worker_reports(self) -> list:
        """Each worker's statistics (WorkerReport), counting everything this client issued
        before the call: it syncs first, and the dispatcher answers after a heartbeat from each
        worker that left after the sync's reply."""
        self.sync()
        self.connection.send(messages.WorkerStatsRequest())
        return self._await(messages.WorkerStats, lambda reply: True).workers

    def configure(self, config: dict) -> list[str]:
        """Send a signal configuration (checked by the dispatcher against its workers);
        -> the signal names. Raises ConfigError with one line per problem."""
        self.flush()
        self.connection.send(messages.Configure(config))
        reply = self._await((messages.Configured, messages.Error), lambda reply: True)
        if isinstance(reply, messages.Error):
            raise signals.ConfigError(reply.message.splitlines())
        self.signal_config = config
        self._compiled_signals = frozenset(name for name, settings in config.items()
                                           if isinstance(settings, dict) and settings.get("compile") is True)
        self._regions = None  # look at the region stack again at the next instruction
        return reply.signals

    def load_config(self, source) -> list[str]:
        """Use the signals of a YAML file (or a dict) from now on; -> their names."""
        return self.configure(dict(signals.load(source)))

    def _send(self, token, fetch) -> None:
        batch, self._batch = self._batch, []
        frames, self._frames = self._frames, []
        self.connection.send(messages.Run(batch, token, fetch, frames))

    def _await(self, kinds, matches):
        """The dispatcher's next reply of `kinds` for which `matches(reply)`."""
        while True:
            reply = self.connection.receive()
            if isinstance(reply, kinds) and matches(reply):
                return reply
            if isinstance(reply, messages.Error):
                raise FrontendError(f"the dispatcher could not take our message: {reply.message}")

    def _remote_error(self, errors: list, issued: dict) -> FrontendError:
        first = errors[0]
        if first.seq < 0:  # not an instruction's: a worker lost
            more = f" (and {len(errors) - 1} more error(s) since the last sync)" if len(errors) > 1 else ""
            return WorkerLost(f"{first.message}; tensors that lived there are gone{more}")
        op, input_shapes, (filename, line) = issued.get(first.seq, (first.op, [], ("?", 0)))
        return RemoteError(op, first.inputs or input_shapes, first.worker, f"{filename}:{line}", first.message,
                           more=len(errors) - 1)

    # ---- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Run what is still queued and report its errors (RemoteError), then say goodbye (the
        dispatcher frees this client's tensors) and close the connection."""
        if self._closed:
            return
        try:
            if self._issued:
                if self.lost is not None:
                    raise ConnectionLost(f"{len(self._issued)} instruction(s) issued after the last sync never "
                                         f"ran: the dispatcher at {self.address} no longer serves this client: {self.lost}")
                self.sync()
        finally:
            self._closed = True
            self.connection.close()

    def _check_open(self) -> None:
        if self._closed:
            raise FrontendError("this frontend session is closed")
        if self.connection.lost is not None:
            self.connection.check()


def _plain(arg, session):
    """numpy scalars as Python numbers, numpy arrays as uploaded tensors."""
    if isinstance(arg, np.generic):
        return arg.item()
    if isinstance(arg, np.ndarray):
        return session.upload(arg)
    return arg


def _assemble(frames, entry: Fetched) -> np.ndarray:
    """A fetched tensor from its parts (a split tensor comes as one part per worker, in order)."""
    if entry.parts == 1:
        return array_from_frame(next(frames), entry.dtype, entry.shape)
    if entry.axis is None or entry.axis >= len(entry.shape):
        raise FrontendError(f"tensor h{entry.handle} came in {entry.parts} parts along axis {entry.axis} "
                            f"of a {len(entry.shape)}-d shape")
    pieces = []
    for length in part_sizes(entry.shape[entry.axis], entry.parts):
        local = list(entry.shape)
        local[entry.axis] = length
        pieces.append(array_from_frame(next(frames), entry.dtype, local))
    return np.concatenate(pieces, axis=entry.axis)


def _describe(tensor) -> str:
    return f"{tensor.dtype}{list(tensor.shape)}"


def _caller() -> tuple[str, int]:
    """The first frame outside the frontend package: the user's line."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("?", 0)

"""A client's connection to a dispatcher, and its instruction stream.

Nothing waits for a worker until the program needs a value: instructions are appended to a
batch and sent when it is full or at a *sync point* (a value read with `.item()`,
`.numpy()`, `print`...). A sync asks every worker this client used to report the errors since
the last sync and the values asked for; the first error is raised here, naming the operation,
its inputs, the worker and the line of the program that issued it.

The client chooses the handles of its tensors itself, so creating a result costs no round
trip. A daemon thread sends a heartbeat on its own socket, so that the dispatcher can tell a
client that died from one that is thinking.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import zmq

from paratrain.frontend import wire
from paratrain.frontend.client import autograd, shapes, signal
from paratrain.frontend.errors import (
    DispatcherUnreachable, FrontendError, ProtocolError, RemoteError,
)
from paratrain.frontend.handshake import handshake
from paratrain.frontend.ops import OPS
from paratrain.frontend.sharding import part_sizes

BATCH_SIZE = 256  # instructions per message when nothing forces a send earlier
MAX_UNSYNCED = 16  # batches in flight before the client waits for the workers to catch up
HEARTBEAT_S = 2.0
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Session:
    def __init__(self, address: str, *, token: str | None = None, timeout: float | None = None,
                 connect_timeout: float = 60.0, name: str | None = None):
        from paratrain.comm.settings import timeout_from_env

        self.address = address
        self.timeout = timeout if timeout is not None else timeout_from_env()
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{address}")
        info = {"pid": os.getpid(), "name": name or os.path.basename(sys.argv[0] or "python")}
        try:
            welcome = handshake(self.sock, "client", token, info, connect_timeout, address)
        except BaseException:
            self.sock.close(linger=0)
            self.context.term()
            raise
        self.slot, self.n_workers, self.home = welcome["client"], welcome["workers"], welcome["home"]
        self.devices, self.logging = welcome.get("devices", []), bool(welcome.get("log"))
        self.max_message_bytes = int(welcome.get("max_message_mb", wire.DEFAULT_MAX_MESSAGE_MB)) << 20
        self.server_alive = lambda: True  # set by whoever started the server, to fail fast
        self.placement: int | None = None  # the worker new tensors go to (None: home)
        self.signal_config: dict = {}  # what configure() last sent (signal name -> settings)
        self.worker_stats: dict = {}  # per worker, as of the last sync: busy_s, wait_s (cumulative)
        self._next_handle = 0
        self._seq = 0
        self._batch: list = []
        self._frames: list = []
        self._issued: dict[int, tuple] = {}  # seq -> (op, input shapes, (file, line)) until a sync
        self._unsynced = 0
        self.closed = False
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(welcome["secret"],),
                                           name="frontend-heartbeat", daemon=True)
        self._heartbeat.start()

    # ---- issuing ------------------------------------------------------------------------------

    def new_handle(self) -> int:
        handle = self._next_handle
        self._next_handle += 1
        return handle

    def call(self, name: str, args: list, kwargs: dict | None = None, *, flags: dict | None = None):
        """Issue `name(*args, **kwargs)`; -> its result tensors (a list; empty for in-place ops)."""
        from paratrain.frontend.client.tensor import Tensor

        self._check_open()
        kwargs = kwargs or {}
        args = [_plain(arg, self) for arg in args]
        targs = [i for i, arg in enumerate(args) if isinstance(arg, Tensor)]
        for i in targs:
            if args[i]._session is not self:
                raise ValueError(f"{name}: a tensor of another client (session) cannot be used here")
        results = shapes.infer(name, args, targs, kwargs)
        op = OPS[name]
        grad_on = autograd.is_grad_enabled()
        parents = tuple(args[i] for i in targs if args[i].requires_grad) if grad_on and op.differentiable else ()
        if op.kind == "inplace":
            self._check_inplace(name, args[0], parents)
            outs = []
        else:
            outs = [Tensor(self, self.new_handle(), shape, dtype, bool(parents) and _floating(dtype))
                    for shape, dtype in results]
            for out in outs:
                if out.requires_grad:
                    out._parents = parents
        if grad_on is False:
            flags = {**(flags or {}), "ng": 1}
        wire_args = [arg._handle if isinstance(arg, Tensor) else arg for arg in args]
        self._append(name, [out._handle for out in outs], wire_args, targs, kwargs, flags,
                     [args[i] for i in targs], outs)
        if op.kind == "inplace" and parents:
            target = args[0]
            target.requires_grad = True
            target._parents = tuple(dict.fromkeys((*target._parents, *parents)))
        return outs

    def issue(self, name: str, outs: list[int], args: list, targs: list, kwargs: dict | None = None,
              flags: dict | None = None, tensors: tuple = (), results: tuple = ()) -> None:
        """Issue an instruction whose results the caller makes itself (grad, uploads...)."""
        self._check_open()
        self._append(name, outs, args, targs, kwargs or {}, flags, tensors, results)

    def upload(self, array: np.ndarray, flags: dict | None, requires_grad: bool = False):
        """Queue a numpy array's bytes for a new tensor; -> the tensor."""
        from paratrain.frontend.client.tensor import Tensor

        array = np.ascontiguousarray(array)
        if not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        if array.nbytes > self.max_message_bytes:
            raise ValueError(
                f"a {array.nbytes / 2**20:.1f} MiB array is over the server's message limit of "
                f"{self.max_message_bytes >> 20} MiB (paratrain serve --max-message-mb); create it on the "
                "workers (gt.randn, gt.zeros...) or upload it in pieces"
            )
        dtype = wire.numpy_dtype_name(array)
        tensor = Tensor(self, self.new_handle(), array.shape, dtype, requires_grad)
        kwargs = {"dtype": dtype, "shape": list(array.shape), "frame": len(self._frames)}
        self._frames.append(memoryview(array).cast("B") if array.size else b"")
        self.issue("upload", [tensor._handle], [], [], kwargs, flags, results=(tensor,))
        return tensor

    def _append(self, name, outs, args, targs, kwargs, flags, inputs, results) -> None:
        region = signal.current()
        if region is not None:
            flags = {**(flags or {}), "s": region}
        self._seq += 1
        self._issued[self._seq] = (name, [_describe(t) for t in inputs], _caller())
        self._batch.append([self._seq, name, outs, args, targs, kwargs, flags])
        if len(self._batch) >= BATCH_SIZE:
            self.flush()

    def _check_inplace(self, name, target, parents) -> None:
        if autograd.is_grad_enabled() and target.requires_grad and not target._parents:
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
        if batch and batch[-1][1] == "free":
            batch[-1][3].append(handle)
        else:
            batch.append([0, "free", [], [handle], [], {}, None])

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
        self._seq += 1
        token = self._seq
        self._send(token, list(fetch))
        self._unsynced = 0
        reply, frames = self._await(token)
        issued, self._issued = self._issued, {}
        errors = reply.get("errors") or []
        if errors:
            raise self._remote_error(errors, issued)
        self.worker_stats = {int(k): v for k, v in (reply.get("stats") or {}).items()}
        values, frame_iter = [], iter(frames)
        for handle, dtype, detail, *layout in reply.get("fetched") or []:
            if dtype is None:
                raise FrontendError(f"cannot read tensor h{handle}: {detail}")
            values.append(_assemble(frame_iter, dtype, detail, *layout))
        return values

    def configure(self, signals: dict) -> list[str]:
        """Send a signal configuration (checked by the dispatcher against its workers);
        -> the signal names. Raises ConfigError with one line per problem."""
        from paratrain.frontend.signals import ConfigError

        self.flush()
        self.sock.send(wire.encode({"t": "config", "signals": signals}))
        while True:
            reply, _ = self._next_reply()
            if reply["t"] == "configured":
                return reply["signals"]
            if reply["t"] == "error":
                raise ConfigError(reply["message"].splitlines())

    def _send(self, token, fetch) -> None:
        ops, self._batch = self._batch, []
        header = {"t": "run", "ops": ops, "sync": token, "fetch": fetch}
        try:
            self.sock.send_multipart([wire.encode(header), *self._frames], copy=False)
        finally:
            self._frames = []

    def _await(self, token: int):
        while True:
            reply, frames = self._next_reply()
            if reply["t"] == "synced" and reply.get("token") == token:
                return reply, frames
            if reply["t"] == "error":
                raise ProtocolError(f"the dispatcher rejected a message: {reply.get('message')}")

    def _next_reply(self):
        """The dispatcher's next message (header, frames); fails fast if its server has exited."""
        waited = 0.0
        while not self.sock.poll(1000, zmq.POLLIN):
            waited += 1.0
            if not self.server_alive():
                raise FrontendError(f"the frontend server at {self.address} has exited (its messages are above)")
            if waited >= self.timeout:
                raise DispatcherUnreachable(
                    f"no answer from the dispatcher at {self.address} within {self.timeout:g}s "
                    "(PARATRAIN_TIMEOUT sets the limit)"
                )
        frames = self.sock.recv_multipart(copy=False)
        return wire.decode(frames[0].bytes), frames[1:]

    def _remote_error(self, errors: list, issued: dict) -> RemoteError:
        seq, name, worker_shapes, worker, message = errors[0]
        op, input_shapes, (filename, line) = issued.get(seq, (name, [], ("?", 0)))
        return RemoteError(op, worker_shapes or input_shapes, worker, f"{filename}:{line}", message,
                           more=len(errors) - 1)

    # ---- lifetime -------------------------------------------------------------------------------

    def _beat(self, secret: bytes) -> None:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{self.address}")
        try:
            while not self._stop_heartbeat.wait(HEARTBEAT_S):
                sock.send(wire.encode({"t": "alive", "secret": secret}))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        """Say goodbye (the dispatcher frees this client's tensors) and close the sockets."""
        if self.closed:
            return
        self.closed = True
        self._stop_heartbeat.set()
        self._heartbeat.join(timeout=5)
        try:
            self.sock.send(wire.encode({"t": "bye"}))
        finally:
            self.sock.close(linger=500)
            self.context.term()

    def _check_open(self) -> None:
        if self.closed:
            raise FrontendError("this frontend session is closed")


def _plain(arg, session):
    """numpy scalars as Python numbers, numpy arrays as uploaded tensors."""
    if isinstance(arg, np.generic):
        return arg.item()
    if isinstance(arg, np.ndarray):
        from paratrain.frontend.client.tensor import from_numpy

        return from_numpy(arg, session=session)
    return arg


def _assemble(frames, dtype, shape, parts=1, axis=None) -> np.ndarray:
    """A fetched tensor from its parts (a split tensor comes as one part per worker)."""
    if parts == 1:
        return wire.array_from_frame(next(frames).buffer, dtype, shape)
    pieces, lengths = [], part_sizes(shape[axis], parts)
    for length in lengths:
        local = list(shape)
        local[axis] = length
        pieces.append(wire.array_from_frame(next(frames).buffer, dtype, local))
    return np.concatenate(pieces, axis=axis)


def _floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _describe(tensor) -> str:
    return f"{tensor.dtype}{list(tensor.shape)}"


def _caller() -> tuple[str, int]:
    """The first frame outside the frontend package: the user's line."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("?", 0)

"""A frontend worker: one process, one device, one rank of the workers' paratrain world.

Two threads. The I/O thread owns the ZeroMQ socket to the dispatcher: it queues incoming
batches, sends replies, and sends a heartbeat with this worker's statistics twice a second, so
that a worker busy with a long matmul is still seen alive. The executor thread runs the queued
instructions in order (see `executor.py`). A worker that hears nothing from its dispatcher for
`DISPATCHER_SILENCE_S`, or whose `exit_with_pid` process is gone, exits by itself, so a killed
server never leaves workers behind.
"""

from __future__ import annotations

import gc
import os
import queue
import sys
import threading
import time

import torch
import zmq

from paratrain.frontend.protocol import VERSION, MalformedMessage, codec, messages
from paratrain.frontend.protocol.addresses import endpoint, resolve, split_address
from paratrain.frontend.protocol.handshake import ACCEPTS, join
from paratrain.frontend.protocol.records import ErrorReport, Fetched
from paratrain.frontend.workers.executor import Executor
from paratrain.lifetime import process_alive
from paratrain.frontend.workers.compile_settings import CompileSettings
from paratrain.environment import Settings

HEARTBEAT_S = 0.5
DISPATCHER_SILENCE_S = 20.0  # a loaded host stalled a dispatcher for 7 s (it pings every second)
_ACCEPTS = ACCEPTS["worker"]


class DeviceUnavailable(RuntimeError):
    """The device this worker was asked to use is not there."""


def worker_device(local_rank: int, backend: str | None = None) -> torch.device:
    """One GPU per worker where there are GPUs, unless `backend` (--backend, or GT_BACKEND /
    PARATRAIN_BACKEND) asks for the CPU ('numpy' is GT's name for its CPU backend)."""
    backend = (backend or "").lower()
    if backend in ("numpy", "cpu"):
        return torch.device("cpu")
    if hasattr(torch, "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if backend == "cuda":
        raise DeviceUnavailable("GT_BACKEND/PARATRAIN_BACKEND asks for cuda, but torch sees no GPU")
    return torch.device("cpu")


def run_worker(address: str, token: str | None = None, *, group=None, local_rank: int = 0,
               threads: int | None = None, connect_timeout: float = 120.0, exit_with_pid: int | None = None,
               backend: str | None = None, name: str | None = None,
               compile_settings: CompileSettings = CompileSettings(), settings: Settings = Settings()) -> None:
    """Serve the dispatcher at `address` until it says exit (or goes silent).

    `group` is this worker's paratrain Group when a launcher already formed the world
    (torchrun); without one the dispatcher numbers the workers as they arrive and hands out a
    store to meet at. Waits at most `connect_timeout` seconds for the dispatcher to answer,
    saying so every few seconds. `backend`: see worker_device; `name`: what `paratrain top`
    calls this worker (default: the program's name); `settings`: the process's (timeout,
    shared memory, algorithm table of the world it forms, and the host name it reports, which
    PARATRAIN_HOST sets as it does a rank's).
    """
    if threads:
        torch.set_num_threads(threads)
    device = worker_device(local_rank, backend)
    target = endpoint(address)  # resolves the host now: an unknown host is an error, not a silent wait
    context = zmq.Context()
    sock = None
    hello = messages.Hello("worker", VERSION, os.getpid(), (name or os.path.basename(sys.argv[0] or "python"))[:256],
                           settings.host_name[:256], str(device), group.rank if group is not None else None)
    own_group = group is None
    try:
        sock, welcome = join(context, target, hello, token, connect_timeout, address, on_wait=_waiting_notice(address))
        if own_group:
            group = _join_world(welcome, device, resolve(split_address(address)[0]), settings)
        executor = Executor(group, device, compile_settings, numpy_products=(backend or "").lower() == "numpy",
                            max_reply_bytes=welcome.max_message_mb << 20)
        _WorkerLoop(sock, context, executor, exit_with_pid, cut=codec.cuts(token)).run()
    finally:
        if sock is not None:
            sock.close(linger=0)
        context.term()
        if own_group and group is not None:
            _leave_world(group)


def _waiting_notice(address: str):
    said = [0.0]

    def notice(waited: float) -> None:
        if waited - said[0] >= 10.0 or said[0] == 0.0:
            print(f"paratrain worker: waiting for the dispatcher at {address} ({waited:.0f}s)", file=sys.stderr,
                  flush=True)
            said[0] = max(waited, 1e-9)
    return notice


def _join_world(welcome: messages.WorkerWelcome, device: torch.device, dispatcher_host: str, settings: Settings):
    """Form the workers' world through the store the dispatcher hosts."""
    from datetime import timedelta

    import torch.distributed as dist

    from paratrain.comm import Group, TorchTransport, over_process_group
    from paratrain.launch import algorithm_table

    timeout = settings.timeout
    store = dist.TCPStore(dispatcher_host, welcome.store_port, welcome.size, is_master=False,
                          timeout=timedelta(seconds=timeout))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=welcome.rank, world_size=welcome.size,
                            timeout=timedelta(seconds=timeout))
    transport = over_process_group(TorchTransport(), settings)
    return Group(transport, table=algorithm_table(settings, welcome.size), settings=settings)


def _leave_world(group) -> None:
    import torch.distributed as dist

    group.close()
    if dist.is_initialized():
        dist.destroy_process_group()


class _WorkerLoop:
    def __init__(self, sock, context, executor: Executor, exit_with_pid: int | None, cut: bool = False):
        self.sock, self.context, self.executor = sock, context, executor
        self.cut = cut  # a dispatcher with a token takes parts cut into pieces (codec.py)
        self.exit_with_pid = exit_with_pid
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.received = 0  # instructions queued so far; minus executed = queue depth
        self.busy_s = 0.0
        self.executor_death: str | None = None  # why the executor thread ended, if it did

    def run(self) -> None:
        # Everything made so far (torch, the world) lives as long as the process: out of the
        # collector's way, or each collection rescans it while batches of instructions are
        # decoded (it tripled the cost of decoding one).
        gc.freeze()
        wake_address = f"inproc://wake-{id(self)}"
        wake = self.context.socket(zmq.PULL)
        wake.bind(wake_address)
        runner = threading.Thread(target=self._execute_forever, args=(wake_address,),
                                  name="frontend-executor", daemon=True)
        runner.start()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        heard, last_beat = time.monotonic(), 0.0
        try:
            while True:
                events = dict(poller.poll(int(HEARTBEAT_S * 1000)))
                now = time.monotonic()
                if self.sock in events:
                    heard = now
                    if not self._receive_all():
                        break
                if wake in events:
                    while wake.poll(0):
                        wake.recv()
                    self._send_replies()
                if now - last_beat >= HEARTBEAT_S:
                    self._send_heartbeat()
                    last_beat = now
                    if self.exit_with_pid is not None and not process_alive(self.exit_with_pid):
                        break
                if not runner.is_alive():  # it never ends by itself: say so now, not by falling silent
                    self._leave(f"its executor thread ended ({self.executor_death or 'no reason given'})")
                    break
                if now - heard > DISPATCHER_SILENCE_S:
                    print(f"paratrain worker {self.executor.rank}: no word from the dispatcher for "
                          f"{DISPATCHER_SILENCE_S:g}s; exiting", file=sys.stderr)
                    break
        finally:
            self.inbox.put(None)
            runner.join(timeout=30)
            self._send_replies()
            wake.close(linger=0)

    def _receive_all(self) -> bool:
        """Queue every message waiting for the executor thread, which decodes it (this thread
        only reads its type: decoding here would hold the interpreter lock the executor needs);
        False when told to exit. All of them, not one: the dispatcher sends a batch and its sync
        back to back, and once the executor runs the batch this thread waits for the lock to read
        the sync."""
        while self.sock.poll(0, zmq.POLLIN):
            frames = [frame.buffer for frame in self.sock.recv_multipart(copy=False)]
            kind, count = codec.peek(frames, count_of="instructions")
            if kind == messages.Exit.KIND:
                return False
            if kind != messages.Ping.KIND:
                self.received += count
                self.inbox.put(frames)
        return True

    def _execute_forever(self, wake_address: str) -> None:
        device = self.executor.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        wake = self.context.socket(zmq.PUSH)
        wake.connect(wake_address)
        try:
            while (frames := self.inbox.get()) is not None:
                try:
                    message = codec.decode(frames, _ACCEPTS)
                except MalformedMessage as error:
                    print(f"paratrain worker {self.executor.rank}: dropped a malformed message from the dispatcher: "
                          f"{error}", file=sys.stderr, flush=True)
                    continue
                try:
                    replies = [codec.encode(reply, self.cut) for reply in self._execute(message)]
                except Exception as error:  # noqa: BLE001 - this message fails, the executor goes on
                    replies = [codec.encode(reply, self.cut) for reply in self._failed(message, error)]
                for reply in replies:
                    self.outbox.put(reply)  # encoded here: the I/O thread only sends
                if replies:
                    wake.send(b"")
        except BaseException as error:
            self.executor_death = f"{type(error).__name__}: {error}"
            raise
        finally:
            wake.close(linger=0)

    def _execute(self, message) -> list:
        """Run one message; -> the replies."""
        executor, replies = self.executor, []
        if isinstance(message, messages.Tasks):
            started = time.perf_counter()
            timings = [] if message.timed else None
            executor.run_batch(message.slot, message.instructions, message.frames, timings)
            self.busy_s += time.perf_counter() - started
            if timings:
                replies.append(messages.Timings(timings))
            if message.sync is not None:
                replies += self._collect(message.slot, message.sync, message.fetch)
        elif isinstance(message, messages.Collect):
            replies += self._collect(message.slot, message.token, message.fetch)
        elif isinstance(message, messages.Forget):
            executor.forget(message.slot)
        return replies

    def _failed(self, message, error: Exception) -> list:
        """A message whose handling raised (a bug, not a failed instruction: those are recorded
        as they run): its client hears of it at the sync it carries, or at its next one."""
        text = f"worker {self.executor.rank} could not handle a {message.KIND}: {type(error).__name__}: {error}"[:4096]
        print(f"paratrain worker {self.executor.rank}: {text}", file=sys.stderr, flush=True)
        slot = getattr(message, "slot", None)
        if slot is None or isinstance(message, messages.Forget):  # a client that left hears nothing
            return []
        report = ErrorReport(-1, message.KIND, [], self.executor.rank, text)
        token = message.token if isinstance(message, messages.Collect) else getattr(message, "sync", None)
        if token is None:
            self.executor.errors[slot].append(report)
            return []
        errors = [*self.executor.errors.pop(slot, []), report]
        fetched = [Fetched(handle, None, [], 0, None, text) for handle in message.fetch]
        return [messages.Collected(token, errors, fetched, slot, self.busy_s, self.executor.wait_s,
                                   list(self.executor.regions.counts))]

    def _leave(self, reason: str) -> None:
        print(f"paratrain worker {self.executor.rank}: leaving: {reason}", file=sys.stderr, flush=True)
        try:
            self.sock.send_multipart(codec.encode(messages.Leaving(reason[:4096])), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the dispatcher then notices the silence instead

    def _collect(self, slot: int, token: int, fetch: list) -> list:
        """The answer to a sync: what a compiled region held back runs first (with its log
        lines, if any), then the errors and values go out."""
        executor, timings = self.executor, []
        started = time.perf_counter()
        executor.regions.flush(slot, timings)
        self.busy_s += time.perf_counter() - started
        errors, fetched, frames = executor.collect(slot, fetch)
        replies = [messages.Timings(timings)] if timings else []
        replies.append(messages.Collected(token, errors, fetched, slot, self.busy_s, executor.wait_s,
                                          list(executor.regions.counts), frames=frames))
        return replies

    def _send_replies(self) -> None:
        while not self.outbox.empty():
            self.sock.send_multipart(self.outbox.get(), copy=False)

    def _send_heartbeat(self) -> None:
        # dict() copies the executor thread's Counter in one C call, under the interpreter lock:
        # no update can interleave with it.
        executor = self.executor
        beat = messages.Heartbeat(executor.executed, self.busy_s, self.received - executor.executed,
                                  executor.memory_bytes(), dict(executor.by_op))
        self.sock.send_multipart(codec.encode(beat))

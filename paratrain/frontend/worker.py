"""A frontend worker: one process, one device, one rank of the workers' paratrain world.

Two threads. The I/O thread owns the ZeroMQ socket to the dispatcher: it queues incoming
batches, sends replies, and sends a heartbeat with this worker's statistics twice a second, so
that a worker busy with a long matmul is still seen alive. The executor thread runs the queued
instructions in order (see `executor.py`). A worker that hears nothing from its dispatcher for
`DISPATCHER_SILENCE_S` exits by itself, so a killed server never leaves workers behind.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time

import torch
import zmq

from paratrain.frontend import wire
from paratrain.frontend.executor import Executor
from paratrain.frontend.handshake import handshake

HEARTBEAT_S = 0.5
DISPATCHER_SILENCE_S = 10.0


def worker_device(local_rank: int) -> torch.device:
    """One GPU per worker where there are GPUs, unless GT_BACKEND / PARATRAIN_BACKEND asks
    for the CPU ('numpy' is GT's name for its CPU backend)."""
    backend = (os.environ.get("PARATRAIN_BACKEND") or os.environ.get("GT_BACKEND") or "").lower()
    if backend in ("numpy", "cpu"):
        return torch.device("cpu")
    if hasattr(torch, "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if backend == "cuda":
        raise RuntimeError("GT_BACKEND/PARATRAIN_BACKEND asks for cuda, but torch sees no GPU")
    return torch.device("cpu")


def run_worker(address: str, token: str | None = None, *, group=None, local_rank: int = 0,
               threads: int | None = None) -> None:
    """Serve the dispatcher at `address` until it says exit (or goes silent).

    `group` is this worker's paratrain Group when a launcher already formed the world (the
    elastic launcher, torchrun); without one the dispatcher numbers the workers as they arrive
    and hands out a store to meet at.
    """
    if threads:
        torch.set_num_threads(threads)
    device = worker_device(local_rank)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    hello = {"rank": group.rank if group is not None else None, "pid": os.getpid(),
             "host": socket.gethostname(), "device": str(device)}
    own_group = group is None
    try:
        welcome = handshake(sock, "worker", token, hello, timeout=None)
        if own_group:
            group = _join_world(welcome, device, wire.split_address(address)[0])
        _WorkerLoop(sock, context, Executor(group, device)).run()
    finally:
        sock.close(linger=0)
        context.term()
        if own_group and group is not None:
            _leave_world(group)


def _join_world(welcome: dict, device: torch.device, dispatcher_host: str):
    """Form the workers' world through the store the dispatcher hosts."""
    from datetime import timedelta

    import torch.distributed as dist

    from paratrain.comm import Group, TorchTransport
    from paratrain.comm.settings import timeout_from_env

    rank, size = welcome["rank"], welcome["size"]
    store_host, store_port = welcome["store"]
    store_host = store_host or dispatcher_host  # the store runs beside the dispatcher
    timeout = timeout_from_env()
    store = dist.TCPStore(store_host, store_port, size, is_master=False,
                          timeout=timedelta(seconds=timeout))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout))
    return Group(TorchTransport(), timeout=timeout)


def _leave_world(group) -> None:
    import torch.distributed as dist

    group.close()
    if dist.is_initialized():
        dist.destroy_process_group()


class _WorkerLoop:
    def __init__(self, sock, context, executor: Executor):
        self.sock, self.context, self.executor = sock, context, executor
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.received = 0  # instructions queued so far; minus executed = queue depth
        self.busy_s = 0.0

    def run(self) -> None:
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
                    if not self._receive():
                        break
                if wake in events:
                    while wake.poll(0):
                        wake.recv()
                    self._send_replies()
                if now - last_beat >= HEARTBEAT_S:
                    self._send_heartbeat()
                    last_beat = now
                if now - heard > DISPATCHER_SILENCE_S:
                    print(f"paratrain worker {self.executor.rank}: no word from the dispatcher for "
                          f"{DISPATCHER_SILENCE_S:g}s; exiting", file=sys.stderr)
                    break
        finally:
            self.inbox.put(None)
            runner.join(timeout=30)
            self._send_replies()
            wake.close(linger=0)

    def _receive(self) -> bool:
        """Queue one message for the executor; False when told to exit."""
        frames = self.sock.recv_multipart(copy=False)
        header = wire.decode(frames[0].bytes)
        kind = header["t"]
        if kind == "exit":
            return False
        if kind == "run":
            self.received += len(header["ops"])
            self.inbox.put((header, [frame.buffer for frame in frames[1:]]))
        elif kind in ("sync", "drop"):
            self.inbox.put((header, []))
        return True

    def _execute_forever(self, wake_address: str) -> None:
        device = self.executor.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        wake = self.context.socket(zmq.PUSH)
        wake.connect(wake_address)
        try:
            while (item := self.inbox.get()) is not None:
                header, frames = item
                reply = self._execute(header, frames)
                if reply is not None:
                    self.outbox.put(reply)
                    wake.send(b"")
        finally:
            wake.close(linger=0)

    def _execute(self, header: dict, frames: list):
        kind, slot = header["t"], header["slot"]
        if kind == "run":
            started = time.perf_counter()
            timings = [] if header.get("log") else None
            self.executor.run_batch(slot, header["ops"], frames, timings)
            self.busy_s += time.perf_counter() - started
            return [wire.encode({"t": "done", "timings": timings})] if timings else None
        if kind == "sync":
            errors, fetched, tensor_frames = self.executor.sync(slot, header["fetch"])
            reply = {"t": "synced", "slot": slot, "token": header["token"], "errors": errors,
                     "fetched": fetched, "stats": {"busy_s": self.busy_s, "wait_s": self.executor.wait_s}}
            return [wire.encode(reply), *tensor_frames]
        self.executor.drop(slot)
        return None

    def _send_replies(self) -> None:
        while not self.outbox.empty():
            self.sock.send_multipart(self.outbox.get(), copy=False)

    def _send_heartbeat(self) -> None:
        executor = self.executor
        stats = {"ops": executor.executed, "busy_s": self.busy_s,
                 "queue": self.received - executor.executed, "memory": executor.memory_bytes()}
        self.sock.send(wire.encode({"t": "hb", "stats": stats}))

"""The in-process fabric: N ranks as N threads of one process.

A send posts a reference to the sender's tensor; the receiver copies (or reduces) straight
out of it into its own buffer, then releases the sender. So a message costs one copy, device
to device when the two ranks hold tensors on different devices, and torch's copy and add
kernels release the GIL, so ranks really run in parallel.

Messages are matched by (source, tag, n-th message on that pair and tag): the k-th receive a
rank posts from a peer with a tag takes the k-th message that peer sent it with that tag,
whatever order the waits happen in.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from paratrain.comm.errors import FabricAborted, TransportTimeout
from paratrain.comm.flight import FlightRecords
from paratrain.comm.ops import Splits, combine_, part_bounds, part_sizes, splits_mismatch
from paratrain.comm.transport.base import P2POp


@dataclass
class _Message:
    tensor: torch.Tensor
    delivered: threading.Event = field(default_factory=threading.Event)


class Fabric:
    """The shared state of one in-process world: mailboxes, a rendezvous, an abort flag."""

    def __init__(self, world_size: int, devices: list[torch.device | str] | None = None,
                 trace_dir: str | None = None):
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        self.size = world_size
        self.devices = [torch.device(d) for d in (devices or ["cpu"] * world_size)]
        if len(self.devices) != world_size:
            raise ValueError(f"{len(self.devices)} devices given for {world_size} ranks")
        lock = threading.RLock()  # what a bare Condition() would make
        self._cond = threading.Condition(lock)  # the rendezvous, the abort, the registries
        # A rank waits for its messages on its own condition (same lock): a post wakes only
        # the threads of the rank it is for. One shared condition woke every waiting rank at
        # each message, and on threads each wake-up is a turn of the interpreter lock.
        self._inbox = [threading.Condition(lock) for _ in range(world_size)]
        self._mail: dict[tuple[int, int, int, int], _Message] = {}  # (src, dst, tag, k)
        self._aborted: str | None = None
        self._lost: int | None = None  # the rank whose failure aborted this fabric
        self.global_ranks = tuple(range(world_size))  # a subfabric's are its members' in the root
        # every rank's calls, dumped into `trace_dir` (the settings'); shared by subfabrics
        self.flight = FlightRecords(self.global_ranks, trace_dir)
        self._slots: list[object] = [None] * world_size
        self._arrived = 0
        self._generation = 0
        self._results: dict[int, list[object]] = {}
        self._store = None  # torch.distributed store, if torch_process_group is used
        self._torch_groups: dict[int, object] = {}  # rank -> its gloo process group
        self._children: dict[tuple[int, ...], Fabric] = {}  # subgroups' fabrics, by their ranks

    def torch_process_group(self, rank: int, timeout: float):
        """A gloo process group for this fabric's threads, for code that needs torch's own
        (PyTorch's DDP). Built once per rank, all threads meeting in one in-memory store."""
        from paratrain.comm.transport.threaded_gloo import threaded_gloo_group

        with self._cond:
            if self._store is None:
                import torch.distributed as dist

                self._store = dist.HashStore()
            group = self._torch_groups.get(rank)
        if group is None:  # built outside the lock: every rank must reach the store at once
            group = threaded_gloo_group(self._store, rank, self.size, timeout)
            with self._cond:
                self._torch_groups[rank] = group
        return group

    def endpoint(self, rank: int) -> FabricTransport:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} out of range for a fabric of {self.size}")
        return FabricTransport(self, rank)

    def abort(self, reason: str, rank: int | None = None) -> None:
        """Wake every waiting rank with an error: used when one rank's function (that of
        `rank`, numbered in this fabric) raised. The first abort's reason stays: the ranks that
        fail after it fail because of it."""
        with self._cond:
            if self._aborted is not None:
                return
            self._aborted, self._lost = reason, rank
            for condition in (self._cond, *self._inbox):
                condition.notify_all()
            children = list(self._children.items())
        for ranks, child in children:
            child.abort(reason, ranks.index(rank) if rank in ranks else None)

    def subfabric(self, ranks: tuple[int, ...]) -> Fabric:
        """The fabric of a subgroup (ranks numbered in this fabric), shared by its members."""
        with self._cond:
            child = self._children.get(ranks)
            if child is None:
                child = Fabric(len(ranks), [self.devices[r] for r in ranks])
                child.global_ranks = tuple(self.global_ranks[r] for r in ranks)
                child.flight = self.flight
                if self._aborted is not None:
                    child._aborted = self._aborted
                    child._lost = ranks.index(self._lost) if self._lost in ranks else None
                self._children[ranks] = child
            return child

    def _wait_for(self, condition, ready, deadline: float, peer: int | None, seconds: float):
        """Wait on `condition` (its lock, the fabric's, held by the caller) until ready() is truthy."""
        while True:
            if self._aborted is not None:
                raise FabricAborted(self._aborted, self._lost)
            value = ready()
            if value:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportTimeout(peer, seconds)
            condition.wait(remaining)

    def post(self, key: tuple[int, int, int, int], message: _Message) -> None:
        inbox = self._inbox[key[1]]
        with inbox:
            self._mail[key] = message
            inbox.notify_all()  # all: the rank's main and communication threads may both wait

    def take(self, key: tuple[int, int, int, int], timeout: float) -> _Message:
        deadline = time.monotonic() + timeout
        inbox = self._inbox[key[1]]
        with inbox:
            self._wait_for(inbox, lambda: key in self._mail, deadline, key[0], timeout)
            return self._mail.pop(key)

    def exchange(self, rank: int, value: object, timeout: float) -> list[object]:
        """Every rank hands in one object and gets back the list of all of them (a barrier)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            generation = self._generation
            self._slots[rank] = value
            self._arrived += 1
            if self._arrived == self.size:
                self._results[generation] = [list(self._slots), self.size]
                self._slots = [None] * self.size
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
            entry = self._wait_for(self._cond, lambda: self._results.get(generation), deadline, None, timeout)
            entry[1] -= 1
            if entry[1] == 0:  # the last reader of a generation drops it
                del self._results[generation]
            return entry[0]


class _SendWork:
    kind = "send"

    def __init__(self, fabric: Fabric, message: _Message, peer: int):
        self.fabric, self.message, self.peer = fabric, message, peer

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.message.delivered.wait(min(0.05, max(deadline - time.monotonic(), 0))):
            if self.fabric._aborted is not None:
                raise FabricAborted(self.fabric._aborted, self.fabric._lost)
            if time.monotonic() >= deadline:
                raise TransportTimeout(self.peer, timeout)


class _RecvWork:
    kind = "recv"

    def __init__(self, fabric: Fabric, key: tuple[int, int, int, int], op: P2POp):
        self.fabric, self.key, self.op, self.peer = fabric, key, op, op.peer
        self.done = False

    def wait(self, timeout: float) -> None:
        if self.done:
            return
        message = self.fabric.take(self.key, timeout)
        source, target = message.tensor, self.op.tensor
        if source.numel() != target.numel():
            message.delivered.set()
            raise ValueError(
                f"rank {self.key[1]}: message from rank {self.peer} has {source.numel()} elements,"
                f" the receive buffer {target.numel()}"
            )
        # Each torch call lets go of the interpreter lock, and on a busy host another rank's
        # thread may keep it a while: call only what the message needs.
        if source.shape != target.shape:
            source = source.view(target.shape)
        if self.op.reduce is None:
            target.copy_(source)
        else:
            if source.device != target.device:
                source = source.to(target.device)
            combine_(target, source, self.op.reduce)
        message.delivered.set()
        self.done = True


class FabricTransport:
    """One rank's view of a Fabric."""

    def __init__(self, fabric: Fabric, rank: int):
        self.fabric, self.rank, self.size = fabric, rank, fabric.size
        self.device = fabric.devices[rank]
        self.kind = "fabric"
        self.global_ranks, self.flight = fabric.global_ranks, fabric.flight
        # A fabric message is one copy done by the receiver: nothing overlaps it, so cutting
        # it into segments would only add hand-shakes. Split only very large messages.
        self.segment_bytes = 64 << 20
        self.posts_ahead = True  # a receive is matched by its number, whenever it was posted
        self._counter_lock = threading.Lock()
        self._sent: dict[tuple[int, int], int] = {}
        self._received: dict[tuple[int, int], int] = {}

    def _next(self, counters: dict[tuple[int, int], int], peer: int, tag: int) -> int:
        with self._counter_lock:
            k = counters.get((peer, tag), 0)
            counters[(peer, tag)] = k + 1
            return k

    def start(self, ops: list[P2POp]) -> list:
        works = []
        for op in ops:
            if not 0 <= op.peer < self.size:
                raise ValueError(f"peer rank {op.peer} out of range for world size {self.size}")
            if op.kind == "send":
                key = (self.rank, op.peer, op.tag, self._next(self._sent, op.peer, op.tag))
                message = _Message(op.tensor)
                self.fabric.post(key, message)
                works.append(_SendWork(self.fabric, message, op.peer))
            else:
                key = (op.peer, self.rank, op.tag, self._next(self._received, op.peer, op.tag))
                works.append(_RecvWork(self.fabric, key, op))
        return works

    # The fabric's own collectives: shared memory, every rank reads every input directly.
    # They are the reference our p2p algorithms are tested against on threads.

    def _everyone(self, value: object, timeout: float) -> list:
        return self.fabric.exchange(self.rank, value, timeout)

    def _fold_into(self, out: torch.Tensor, inputs: list, start: int, end: int, op: str, skip=None):
        """out <- out (op) inputs[i][start:end] for every rank i but `skip`, in rank order."""
        for rank, source in enumerate(inputs):
            if rank != skip:
                combine_(out, source[start:end].to(self.device), op)

    def native_all_reduce(self, tensor, op, timeout):
        # Each rank reduces its own part in place, reading the others' buffers directly; then
        # each copies the other parts from their owners. No intermediate buffers: two passes
        # over memory, like the ring, but with no messages.
        inputs = self._everyone(tensor, timeout)
        bounds = part_bounds(tensor.numel(), self.size)
        start, end = bounds[self.rank]
        self._fold_into(tensor[start:end], inputs, start, end, op, skip=self.rank)
        self._everyone(None, timeout)
        for rank, (start, end) in enumerate(bounds):
            if rank != self.rank:
                tensor[start:end].copy_(inputs[rank][start:end])
        self._everyone(None, timeout)  # nobody may change a buffer another rank still reads

    def native_reduce_scatter(self, output, input, op, timeout):
        inputs = self._everyone(input, timeout)
        start, end = part_bounds(input.numel(), self.size)[self.rank]
        # Start from this rank's own part: in place (output is that part of input, as NCCL
        # allows) any other rank's part copied in first would overwrite it unread.
        output.copy_(inputs[self.rank][start:end])
        self._fold_into(output, inputs, start, end, op, skip=self.rank)
        self._everyone(None, timeout)

    def native_all_gather(self, output, input, timeout):
        inputs = self._everyone(input, timeout)
        # Part by part: in place (input is this rank's part of output) torch.cat(out=output)
        # refuses an input that overlaps its output.
        for (start, end), part in zip(part_bounds(output.numel(), self.size), inputs):
            output[start:end].copy_(part)
        self._everyone(None, timeout)

    def native_broadcast(self, tensor, root, timeout):
        inputs = self._everyone(tensor if self.rank == root else None, timeout)
        if self.rank != root:
            tensor.copy_(inputs[root])
        self._everyone(None, timeout)

    def native_reduce(self, tensor, root, op, timeout):
        inputs = self._everyone(tensor, timeout)
        if self.rank == root:
            self._fold_into(tensor, inputs, 0, tensor.numel(), op, skip=root)
        self._everyone(None, timeout)

    def native_all_to_all(self, output, input, timeout, splits=None):
        if splits is not None:
            self._all_to_all_split(output, input, splits, timeout)
            return
        inputs = self._everyone(input, timeout)
        pieces = []
        for source in inputs:
            start, end = part_bounds(source.numel(), self.size)[self.rank]
            pieces.append(source[start:end].to(self.device))
        expected = self.size * part_sizes(input.numel(), self.size)[self.rank]
        if output.numel() != expected:
            raise ValueError(f"all_to_all output needs {expected} elements, got {output.numel()}")
        torch.cat(pieces, out=output)
        self._everyone(None, timeout)

    def _all_to_all_split(self, output, input, splits: Splits, timeout):
        """Uneven parts: each rank hands in its input with its splits, so every rank sees the
        whole matrix of sizes and finds a mismatch the same way (all raise, none waits), then
        copies its part out of each peer's input."""
        everyone = self._everyone((input, splits), timeout)
        mismatch = splits_mismatch([theirs for _, theirs in everyone])
        if mismatch:
            self._everyone(None, timeout)
            raise ValueError(f"all_to_all: {mismatch}")
        start = 0
        with torch.no_grad():  # a collective's write is no autograd op (this may be a pool thread, grad on)
            for source, theirs in everyone:
                offset = sum(theirs.send[: self.rank])
                count = theirs.send[self.rank]
                output[start : start + count].copy_(source[offset : offset + count])
                start += count
        self._everyone(None, timeout)

    def describe(self) -> str:
        return f"fabric: {self.size} ranks as threads of one process, p2p a tensor copy"

    def torch_process_group(self, timeout: float):
        return self.fabric.torch_process_group(self.rank, timeout)

    def split(self, ranks: list[int]) -> FabricTransport:
        """This rank's transport in the subgroup of `ranks` (which must include it)."""
        return self.fabric.subfabric(tuple(ranks)).endpoint(ranks.index(self.rank))

    def native_barrier(self, timeout):
        self._everyone(None, timeout)

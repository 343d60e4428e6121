"""Point-to-point between processes of one host through shared memory, beside gloo.

gloo carries every message over TCP, even between two processes of one host: the sender's
thread writes into a socket, gloo's I/O thread in the receiving process wakes to read it, then
wakes the thread waiting on the receive. On this project's 2-core virtual machine a 128 KiB
activation took a median 265 us to post and 405 us from post to arrival in the pipeline's
steady state, nearly all of it those wake-ups (`bench pipeline`'s excess bubble).

Here each ordered pair of processes of one host shares a ring (shm_ring.py): the sender
copies a message in and moves the head; the receiver copies it out and moves the tail. No
thread of either process needs waking. A rank waiting for a message polls its rings for
`spin_s` (yielding the core to anything else runnable) and only then sleeps on its doorbell,
a named pipe every peer writes a byte to after each message, so a long wait costs no CPU.

What goes this way: `Group`'s point-to-point (isend, irecv, send, recv, sendrecv) of CPU
tensors between ranks of one process group whose processes share /dev/shm, on x86-64 (see
shm_ring.py). Everything else (CUDA tensors, peers on other hosts, every collective) goes to
the process group as before. PARATRAIN_SHM=0 turns it off; PARATRAIN_SHM_BYTES sets each
ring's size (default 4 MiB; a larger message passes through in pieces); PARATRAIN_SHM_SPIN_US
how long a wait polls before it sleeps (default 5000; on cores of its own a rank may poll
longer, on a host with more ranks than cores shorter).

Semantics are gloo's: messages match by (source, tag), in the order they were sent on that
tag, whatever order the receives are posted in. A send completes once its bytes are in the
ring: unlike gloo's, it need not wait for its receive to be posted. A message that arrives
before its receive is posted waits in a buffer of its own. A receive whose buffer is not the
size of the message fails with an error that says both sizes.

Failures: a wait gives up after its timeout (TransportTimeout), and every 50 ms checks that
the peer's process still exists (TransportFailure when it has gone), so a rank that dies is
reported as lost just as gloo's broken connection is.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import platform
import secrets
import select
import threading
import time
from collections import deque

import torch

from paratrain.comm.errors import TransportFailure, TransportTimeout
from paratrain.comm.settings import DEFAULT_TIMEOUT_S
from paratrain.comm.transport.shm_ring import LINE, Fragment, Ring, round_up

DEFAULT_RING_BYTES = 4 << 20
DEFAULT_SPIN_S = 5e-3  # polling before sleeping: longer than most waits between pipeline stages
_LOOK_S = 0.05  # how often a waiting rank checks that its peer's process still exists
_NAP_S = 0.01   # the longest sleep between looks at the rings (a doorbell lost in a race)


def enabled() -> bool:
    """Whether this process offers shared memory to its peers (PARATRAIN_SHM, the platform)."""
    if os.environ.get("PARATRAIN_SHM", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


def ring_bytes_from_env() -> int:
    return round_up(_int_from_env("PARATRAIN_SHM_BYTES", DEFAULT_RING_BYTES, 4 * LINE))


def spin_s_from_env() -> float:
    return _int_from_env("PARATRAIN_SHM_SPIN_US", round(DEFAULT_SPIN_S * 1e6), 0) / 1e6


def _int_from_env(name: str, default: int, least: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {raw!r}") from None
    if value < least:
        raise ValueError(f"{name} must be at least {least}, got {raw!r}")
    return value


class _Send:
    __slots__ = ("peer", "kind", "tag", "bytes", "sent", "done", "error", "owner")

    def __init__(self, owner: SharedMemoryP2P, peer: int, tag: int, data: torch.Tensor):
        self.owner, self.peer, self.kind, self.tag, self.bytes = owner, peer, "send", tag, data
        self.sent, self.done, self.error = 0, False, None

    def wait(self, timeout: float) -> None:
        self.owner.wait(self, timeout)


class _Recv:
    """A posted receive. It fills its buffer from the ring, or, if its message arrived before
    it was posted, from that message's `arrival` once complete."""

    __slots__ = ("peer", "kind", "tag", "bytes", "done", "error", "arrival", "owner")

    def __init__(self, owner: SharedMemoryP2P, peer: int, tag: int, data: torch.Tensor):
        self.owner, self.peer, self.kind, self.tag, self.bytes = owner, peer, "recv", tag, data
        self.done, self.error, self.arrival = False, None, None

    def wait(self, timeout: float) -> None:
        self.owner.wait(self, timeout)

    def landing(self, total: int) -> torch.Tensor | None:
        """Where a message of `total` bytes goes: this buffer, or nowhere if it does not fit."""
        if total != self.bytes.numel():
            self.error = ValueError(f"recv from rank {self.peer} (tag {self.tag}): the message has {total} bytes, "
                                    f"the receive's buffer {self.bytes.numel()}")
            return None
        return self.bytes

    def finish(self) -> None:
        self.done = True

    def take_arrival(self) -> None:
        """Copy a message that came before this receive was posted, once it is complete."""
        if self.arrival is not None and self.arrival.done:
            if self.landing(self.arrival.bytes.numel()) is not None:
                self.bytes.copy_(self.arrival.bytes)
            self.arrival, self.done = None, True


class _Arrival:
    """A message no receive was posted for yet: it lands in a buffer of its own."""

    __slots__ = ("bytes", "done")

    def __init__(self, total: int):
        self.bytes, self.done = torch.empty(total, dtype=torch.uint8), False

    def landing(self, total: int) -> torch.Tensor:
        return self.bytes

    def finish(self) -> None:
        self.done = True


class _Outgoing:
    """This process's end of the ring to one peer."""

    def __init__(self, ring: Ring):
        self.ring, self.head, self.tail = ring, ring.head, ring.tail
        self.queue: deque[_Send] = deque()  # sends not yet wholly in the ring, oldest first


class _Incoming:
    """This process's end of the ring from one peer, and the receives waiting on it."""

    def __init__(self, ring: Ring):
        self.ring, self.tail = ring, ring.tail
        self.posted: dict[int, deque[_Recv]] = {}       # tag -> receives, in posting order
        self.arrived: dict[int, deque[_Arrival]] = {}   # tag -> messages ahead of their receive
        self.current = None  # where the message being read goes (a _Recv or an _Arrival)


class SharedMemoryP2P:
    """A process group's point-to-point, through shared memory to the peers of this host and
    through `inner` (the process group) to the others. Offers what Link needs of a transport."""

    def __init__(self, inner, outgoing: dict[int, Ring], incoming: dict[int, Ring], bells: dict[int, int],
                 bell: tuple[int, int], peers: dict[int, tuple[int, bytes]], spin_s: float = DEFAULT_SPIN_S):
        self.inner = inner
        self.rank, self.size, self.kind = inner.rank, inner.size, inner.kind
        self.posts_ahead = True
        self.spin_s = spin_s
        self._outgoing = {peer: _Outgoing(ring) for peer, ring in outgoing.items()}
        self._incoming = {peer: _Incoming(ring) for peer, ring in incoming.items()}
        self._bells = bells  # peer -> the write end of its doorbell
        self._bell_read, self._bell_write = bell  # our own doorbell (we hold a writer: no EOF)
        self._peers = peers  # peer -> (pid, its /proc start time): to tell it still runs
        self._lock = threading.Lock()  # the rings' state; never held while sleeping

    @property
    def neighbours(self) -> tuple[int, ...]:
        """The ranks reached through shared memory."""
        return tuple(sorted(self._outgoing))

    def start(self, ops) -> list:
        works: list = [None] * len(ops)
        others = []
        with self._lock:
            for index, op in enumerate(ops):
                if op.peer not in self._outgoing or op.tensor.is_cuda or op.reduce:
                    others.append(index)
                    continue
                data = op.tensor.reshape(-1).view(torch.uint8)
                if op.kind == "send":
                    work = works[index] = _Send(self, op.peer, op.tag, data)
                    channel = self._outgoing[op.peer]
                    channel.queue.append(work)
                    self._push(op.peer, channel)
                else:
                    works[index] = self._post_receive(_Recv(self, op.peer, op.tag, data))
        if others:
            for index, work in zip(others, self.inner.start([ops[i] for i in others])):
                works[index] = work
        return works

    def _post_receive(self, receive: _Recv) -> _Recv:
        channel = self._incoming[receive.peer]
        arrived = channel.arrived.get(receive.tag)
        if arrived:
            receive.arrival = arrived.popleft()
            receive.take_arrival()
        else:
            channel.posted.setdefault(receive.tag, deque()).append(receive)
            self._pull(receive.peer, channel)  # its message may be in the ring already
        return receive

    # ---- moving bytes -------------------------------------------------------------------

    def _push(self, peer: int, channel: _Outgoing) -> bool:
        """Write as much of the queued sends to `peer` as the ring has room for."""
        ring, moved = channel.ring, False
        while channel.queue:
            send = channel.queue[0]
            remaining = send.bytes.numel() - send.sent
            free = ring.capacity - (channel.head - channel.tail)
            if free < LINE + round_up(remaining):
                channel.tail = ring.tail  # the receiver may have made room since we last looked
                free = ring.capacity - (channel.head - channel.tail)
            if free < LINE + (LINE if remaining else 0):  # a header, and some payload if any is left
                ring.set_sender_waiting(True)
                break
            length = min(remaining, free - LINE)
            fragment = Fragment(send.tag, send.bytes.numel(), send.sent, length)
            channel.head = ring.write(channel.head, fragment, send.bytes[send.sent : send.sent + length])
            send.sent += length
            moved = True
            if send.sent == send.bytes.numel():
                send.done = True
                channel.queue.popleft()
        if moved and ring.receiver_sleeping:
            self._ring_bell(peer)
        return moved

    def _pull(self, peer: int, channel: _Incoming) -> bool:
        """Read every fragment `peer` has written, into its receive or an arrival buffer."""
        ring = channel.ring
        head = ring.head
        if head == channel.tail:
            return False
        while channel.tail < head:
            fragment = ring.fragment_at(channel.tail)
            if fragment.offset == 0:
                channel.current = self._landing_for(channel, fragment)
            target = channel.current
            into = target.landing(fragment.total)
            if into is not None:
                into = into[fragment.offset : fragment.offset + fragment.length]
            channel.tail = ring.read(channel.tail, fragment, into)
            if fragment.offset + fragment.length == fragment.total:
                target.finish()
                channel.current = None
        if ring.sender_waiting:
            ring.set_sender_waiting(False)
            self._ring_bell(peer)
        return True

    def _landing_for(self, channel: _Incoming, fragment: Fragment):
        posted = channel.posted.get(fragment.tag)
        if posted:
            return posted.popleft()
        arrival = _Arrival(fragment.total)
        channel.arrived.setdefault(fragment.tag, deque()).append(arrival)
        return arrival

    def _progress(self) -> bool:
        """Move every ring this process has a part in: a peer blocked on a full ring to us
        must be read even while we wait for something else, or two ranks sending each other
        more than a ring holds would wait for each other forever."""
        moved = False
        with self._lock:
            for peer, channel in self._outgoing.items():
                if channel.queue and self._push(peer, channel):
                    moved = True
            for peer, channel in self._incoming.items():
                if self._pull(peer, channel):
                    moved = True
        return moved

    def _ring_bell(self, peer: int) -> None:
        try:
            os.write(self._bells[peer], b"\0")
        except BlockingIOError:  # its pipe is full of rings it has not read: it will look anyway
            pass
        except BrokenPipeError:  # it has exited: its waits are over, and ours find out (_check_alive)
            pass

    # ---- waiting ------------------------------------------------------------------------

    def wait(self, work, timeout: float) -> None:
        started = time.perf_counter()
        deadline, look_at, spin_until = started + timeout, started + _LOOK_S, started + self.spin_s
        while not work.done:
            if isinstance(work, _Recv) and work.arrival is not None:
                with self._lock:
                    work.take_arrival()
                if work.done:
                    break
            if self._progress():
                spin_until = time.perf_counter() + self.spin_s
                continue
            now = time.perf_counter()
            if now >= deadline:
                raise TransportTimeout(work.peer, timeout, f"no {work.kind} from rank {work.peer} "
                                       f"through shared memory after {timeout:g}s")
            if now >= look_at:
                self._check_alive(work.peer)
                look_at = now + _LOOK_S
            if now < spin_until:
                os.sched_yield()
            else:
                self._sleep(min(deadline, look_at) - now)
        if work.error is not None:
            raise work.error

    def _sleep(self, seconds: float) -> None:
        """Sleep until a peer rings (or `seconds`, at most _NAP_S). Peers ring only a receiver
        that said it sleeps, so it says so first, then empties its bell and looks at the rings
        once more: a message written in between is not slept past. (Between a sender's check
        of the flag and its head reaching memory, x86 leaves a window of nanoseconds in which
        a ring can be missed; the nap's limit bounds what that costs.)"""
        for channel in self._incoming.values():
            channel.ring.set_receiver_sleeping(True)
        try:
            try:
                os.read(self._bell_read, 1 << 16)  # a system call on a locked pipe: a memory fence too
            except BlockingIOError:
                pass
            if not self._progress():
                select.select([self._bell_read], [], [], max(0.0, min(seconds, _NAP_S)))
        finally:
            for channel in self._incoming.values():
                channel.ring.set_receiver_sleeping(False)

    def _check_alive(self, peer: int) -> None:
        pid, started = self._peers[peer]
        if _start_time(pid) != started:
            raise TransportFailure(peer, f"rank {peer}'s process (pid {pid}) has exited")


# ---- setting up: which peers share this host, and their rings ---------------------------


def _host_key() -> int:
    """Equal for processes that share /dev/shm and see each other's process ids: the boot,
    the /dev/shm file system and the process namespace."""
    with open("/proc/sys/kernel/random/boot_id", "rb") as handle:
        boot = handle.read().strip()
    shm = os.stat("/dev/shm")
    namespace = os.readlink("/proc/self/ns/pid")
    digest = hashlib.blake2b(b"|".join([boot, str(shm.st_dev).encode(), namespace.encode()]), digest_size=7)
    return int.from_bytes(digest.digest(), "little")


def _start_time(pid: int) -> bytes | None:
    """When process `pid` started (None: it is gone or a zombie): a pid reused by a new
    process has another start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in (b"Z", b"X") else fields[19]


def _ring_path(token: int, dst: int) -> str:
    return f"/dev/shm/paratrain-{token:016x}-to-{dst}"


def _bell_path(token: int) -> str:
    return f"/dev/shm/paratrain-{token:016x}-bell"


def connect(inner) -> SharedMemoryP2P | None:
    """Set up shared memory among the ranks of `inner` (a TorchTransport) that share a host; every rank
    calls this (one all-gather, and two barriers where any two ranks share a host). Returns
    None where this rank shares a host with none of the others (or offers no shared memory)."""
    me = torch.zeros(4, dtype=torch.int64)
    offered = enabled()
    token = secrets.randbits(62)
    if offered:
        try:
            me[:] = torch.tensor([1, _host_key(), os.getpid(), token])
        except OSError:  # no /proc: not a Linux we know how to watch
            offered = False
    everyone = torch.empty(inner.size * 4, dtype=torch.int64)
    timeout = inner.own_timeout or DEFAULT_TIMEOUT_S
    inner.native_all_gather(everyone, me, timeout)
    table = everyone.view(inner.size, 4).tolist()
    hosts = {}
    for rank, (offers, key, _, _) in enumerate(table):
        if offers:
            hosts.setdefault(key, []).append(rank)
    if all(len(ranks) < 2 for ranks in hosts.values()):
        return None  # the same answer on every rank: nobody does the barriers below
    neighbours = [r for r in hosts.get(table[inner.rank][1], []) if r != inner.rank] if offered else []
    capacity = ring_bytes_from_env()
    mine = [_ring_path(token, peer) for peer in neighbours] + [_bell_path(token)]
    cleanup = functools.partial(_unlink, mine)
    atexit.register(cleanup)  # only if we fail before the second barrier below
    outgoing, incoming, bells, bell = {}, {}, {}, None
    if neighbours:
        outgoing = {peer: Ring(_ring_path(token, peer), capacity, create=True) for peer in neighbours}
        os.mkfifo(_bell_path(token), 0o600)
        bell = (os.open(_bell_path(token), os.O_RDONLY | os.O_NONBLOCK),
                os.open(_bell_path(token), os.O_WRONLY | os.O_NONBLOCK))
    inner.native_barrier(timeout)  # every ring and doorbell exists
    for peer in neighbours:
        incoming[peer] = Ring(_ring_path(table[peer][3], inner.rank), capacity, create=False)
        bells[peer] = os.open(_bell_path(table[peer][3]), os.O_WRONLY | os.O_NONBLOCK)
    inner.native_barrier(timeout)  # every peer has opened ours: the names can go
    cleanup()
    atexit.unregister(cleanup)
    if not neighbours:
        return None
    peers = {peer: (table[peer][2], _start_time(table[peer][2])) for peer in neighbours}
    return SharedMemoryP2P(inner, outgoing, incoming, bells, bell, peers, spin_s_from_env())


def _unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

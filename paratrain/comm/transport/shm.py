"""Messages between processes of one host through shared memory, beside gloo.

gloo carries every message over TCP, even between two processes of one host: the sender's
thread writes into a socket, gloo's I/O thread in the receiving process wakes to read it, then
wakes the thread waiting on the receive. On this project's 2-core virtual machine a 128 KiB
activation took a median 225-283 us to post and 347-453 us from post to arrival in the pipeline's
steady state, nearly all of it those wake-ups (`bench pipeline`'s excess bubble).

Here each ordered pair of processes of one host shares a ring (shm_ring.py): the sender
copies a message in and moves the head; the receiver copies it out and moves the tail. No
thread of either process needs waking. A rank waiting for a message polls its rings for
`spin_s` (yielding the core to anything else runnable) and only then sleeps on its doorbell,
a named pipe every peer writes a byte to after each message, so a long wait costs no CPU.

What goes this way: every message of a process group (its point-to-point and the messages of
paratrain's own collective algorithms, SharedMemoryTransport.start) whose tensor is on the CPU and whose
peer shares /dev/shm with this process, on x86-64 (see shm_ring.py). Everything else (CUDA
tensors, peers on other hosts, the backend's own collectives) goes to the process group as
before. The settings (paratrain/environment.py): PARATRAIN_SHM=0 turns it off; PARATRAIN_SHM_BYTES
sets each ring's size (default 4 MiB, less beyond 16 peers on the host; a larger message passes
through in pieces); PARATRAIN_SHM_SPIN_US how long a wait polls before it sleeps (default 50000
where the host has a core per rank, 0 where it has fewer).
Only the main thread polls: a wait on a helper thread (an async collective overlapping a
backward pass) sleeps at once, leaving the core to the compute it overlaps. Setting up, and
those settings: shm_setup.py.

A send, or a blocking receive, whose message fits the ring whole with nothing ahead of it goes
straight between its tensor and the ring (send_now, recv_now; in native code where built).

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

import os
import select
import threading
import time
from collections import deque

import torch

from paratrain.comm.errors import TransportFailure, TransportTimeout
from paratrain.comm.transport.shm_ring import LINE, Fragment, Ring, round_up
from paratrain.comm.transport.shm_works import Arrival, Incoming, Outgoing, Recv, Send, take_oldest
from paratrain.lifetime import start_time

_LOOK_S = 0.05  # how often a waiting rank checks that its peer's process still exists
_NAP_S = 0.01   # the longest sleep between looks at the rings (a doorbell lost in a race)


class SharedMemoryP2P:
    """A process group's point-to-point, through shared memory to the peers of this host and
    through `inner` (the process group) to the others. Offers what Link needs of a transport."""

    def __init__(self, inner, outgoing: dict[int, Ring], incoming: dict[int, Ring], bells: dict[int, int],
                 bell: tuple[int, int], peers: dict[int, tuple[int, bytes]], spin_s: float):
        self.inner = inner  # a TorchTransport: what is not ours goes to its process group
        self.rank, self.size, self.kind = inner.rank, inner.size, inner.kind
        self.staging = inner.staging  # where receives that reduce land
        self.spin_s = spin_s
        self._outgoing = {peer: Outgoing(ring) for peer, ring in outgoing.items()}
        self._incoming = {peer: Incoming(ring) for peer, ring in incoming.items()}
        self._bells = bells  # peer -> the write end of its doorbell
        self._bell_read, self._bell_write = bell  # our own doorbell (we hold a writer: no EOF)
        self._peers = peers  # peer -> (pid, its /proc start time): to tell it still runs
        self._lock = threading.Lock()  # the rings' state; never held while sleeping
        self._sleepers = 0  # threads asleep on our doorbell (peers ring while there is one)
        self.arena = None  # the group's shared segment, where all its ranks are here (shm_setup.py)
        self.kernels = None  # native code for send_now/recv_now, where this process built it

    @property
    def neighbours(self) -> tuple[int, ...]:
        """The ranks reached through shared memory."""
        return tuple(sorted(self._outgoing))

    def start(self, ops) -> list:
        works: list = [None] * len(ops)
        others = []
        with self._lock:
            for index, op in enumerate(ops):
                if op.peer not in self._outgoing or op.tensor.is_cuda or not op.tensor.is_contiguous():
                    others.append(index)
                    continue
                if op.kind == "send":
                    work = works[index] = Send(self, op.peer, op.tag, op.tensor)
                    channel = self._outgoing[op.peer]
                    channel.queue.append(work)
                    self._push(op.peer, channel)
                elif op.reduce:  # lands beside its target (see Recv)
                    staging = self.staging.take(op.tensor)
                    receive = Recv(self, op.peer, op.tag, staging, op.tensor, op.reduce)
                    works[index] = self._post_receive(receive)
                else:
                    works[index] = self._post_receive(Recv(self, op.peer, op.tag, op.tensor))
        if others:
            for index, work in zip(others, self.inner.start([ops[i] for i in others])):
                works[index] = work
        return works

    def _post_receive(self, receive: Recv) -> Recv:
        channel = self._incoming[receive.peer]
        arrived = channel.arrived.get(receive.tag)
        if arrived:
            receive.arrival = take_oldest(channel.arrived, receive.tag, arrived)
            receive.take_arrival()
        else:
            channel.posted.setdefault(receive.tag, deque()).append(receive)
            self._pull(receive.peer, channel)  # its message may be in the ring already
        return receive

    # ---- blocking calls' short cut ---------------------------------------------------------
    #
    # A blocking send or receive of a message that fits the ring whole, with nothing ahead of
    # it on that ring, needs none of the machinery above: no work object, no queue, no posted
    # receive. These move it straight between the tensor and the ring, or say False, leaving
    # everything as it was, and the caller takes the general path (which keeps the order).

    def send_now(self, peer: int, tag: int, tensor: torch.Tensor) -> bool:
        """Put `tensor` in the ring to `peer` now, if nothing is queued ahead of it and it fits."""
        channel = self._outgoing.get(peer)
        if channel is None or not channel.populated:
            return False
        ring, nbytes, kernels = channel.ring, tensor.nbytes, self.kernels
        needed = LINE + round_up(nbytes)
        with self._lock:
            if channel.queue:
                return False
            if ring.capacity - (channel.head - channel.tail) < needed:
                channel.tail = ring.tail
                if ring.capacity - (channel.head - channel.tail) < needed:
                    return False
            if kernels is not None:
                word = kernels.ring_put(ring.address, ring.capacity, channel.head, tag, tensor.data_ptr(), nbytes)
                channel.head, sleeping = word >> 1, word & 1
            else:
                channel.head = ring.write(channel.head, Fragment(tag, nbytes, 0, nbytes), tensor.data_ptr())
                sleeping = ring.receiver_sleeping
        if sleeping:
            self.ring_bell(peer)
        return True

    def recv_now(self, peer: int, tag: int, tensor: torch.Tensor, poll_s: float) -> bool:
        """Read the next message from `peer` into `tensor`, if it is the one (this tag, its
        size, whole in the ring) and no message or receive of this tag is ahead of it; polls up
        to `poll_s` for it to come (on the main thread only), looking at nothing else meanwhile."""
        channel = self._incoming.get(peer)
        if channel is None or not channel.populated:
            return False
        ring, kernels = channel.ring, self.kernels
        if poll_s > 0 and threading.current_thread() is threading.main_thread():
            if kernels is not None:
                kernels.ring_poll(ring.address, channel.tail, int(poll_s * 1e9))
            elif ring.head == channel.tail:
                until = time.perf_counter() + poll_s
                while ring.head == channel.tail and time.perf_counter() < until:
                    os.sched_yield()
        with self._lock:
            if channel.current is not None or tag in channel.posted or tag in channel.arrived:
                return False
            if kernels is not None:
                word = kernels.ring_take(ring.address, ring.capacity, channel.tail, tag, tensor.data_ptr(),
                                         tensor.nbytes)
                if word < 0:
                    return False
                channel.tail, waiting = word >> 1, word & 1
            else:
                if ring.head == channel.tail:
                    return False
                fragment = ring.fragment_at(channel.tail)
                if fragment != (tag, tensor.nbytes, 0, tensor.nbytes):
                    return False
                channel.tail = ring.read(channel.tail, fragment, tensor.data_ptr())
                waiting = ring.sender_waiting
            if waiting:
                ring.set_sender_waiting(False)
                self.ring_bell(peer)
        return True

    # ---- moving bytes -------------------------------------------------------------------

    def _push(self, peer: int, channel: Outgoing) -> bool:
        """Write as much of the queued sends to `peer` as the ring has room for."""
        ring, moved = channel.ring, False
        if not channel.populated:
            ring.populate(writing=True)
            channel.populated = True
        while channel.queue:
            send = channel.queue[0]
            remaining = send.nbytes - send.sent
            free = ring.capacity - (channel.head - channel.tail)
            if free < LINE + round_up(remaining):
                channel.tail = ring.tail  # the receiver may have made room since we last looked
                free = ring.capacity - (channel.head - channel.tail)
            if free < LINE + (LINE if remaining else 0):  # a header, and some payload if any is left
                ring.set_sender_waiting(True)
                break
            length = min(remaining, free - LINE)
            fragment = Fragment(send.tag, send.nbytes, send.sent, length)
            channel.head = ring.write(channel.head, fragment, send.address + send.sent)
            send.sent += length
            moved = True
            if send.sent == send.nbytes:
                send.done = True
                channel.queue.popleft()
        if moved and ring.receiver_sleeping:
            self.ring_bell(peer)
        return moved

    def _pull(self, peer: int, channel: Incoming) -> bool:
        """Read every fragment `peer` has written, into its receive or an arrival buffer."""
        ring = channel.ring
        head = ring.head
        if head == channel.tail:
            return False
        if not channel.populated:
            ring.populate(writing=False)
            channel.populated = True
        while channel.tail < head:
            fragment = ring.fragment_at(channel.tail)
            if fragment.offset == 0:
                channel.current = self._landing_for(channel, fragment)
            target = channel.current
            into = target.landing(fragment.total)
            channel.tail = ring.read(channel.tail, fragment, None if into is None else into + fragment.offset)
            if fragment.offset + fragment.length == fragment.total:
                target.finish()
                channel.current = None
        if ring.sender_waiting:
            ring.set_sender_waiting(False)
            self.ring_bell(peer)
        return True

    def _landing_for(self, channel: Incoming, fragment: Fragment):
        posted = channel.posted.get(fragment.tag)
        if posted:
            return take_oldest(channel.posted, fragment.tag, posted)
        arrival = Arrival(fragment.total)
        channel.arrived.setdefault(fragment.tag, deque()).append(arrival)
        return arrival

    def progress(self) -> bool:
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

    def ring_bell(self, peer: int) -> None:
        try:
            os.write(self._bells[peer], b"\0")
        except BlockingIOError:  # its pipe is full of rings it has not read: it will look anyway
            pass
        except BrokenPipeError:  # it has exited: its waits are over, and ours find out (_check_alive)
            pass

    # ---- waiting ------------------------------------------------------------------------

    def wait(self, work, timeout: float) -> None:
        started = time.perf_counter()
        spin_s = self.spin_s if threading.current_thread() is threading.main_thread() else 0.0
        deadline, look_at, spin_until = started + timeout, started + _LOOK_S, started + spin_s
        while not work.done:
            if isinstance(work, Recv) and work.arrival is not None:
                with self._lock:
                    work.take_arrival()
                if work.done:
                    break
            moved = self.progress()
            if work.done:
                break
            now = time.perf_counter()
            if now >= deadline:  # checked even while other rings move: they are not this work
                raise TransportTimeout(work.peer, timeout, f"{work.kind} with rank {work.peer}: nothing "
                                       f"came through shared memory in {timeout:g}s")
            if now >= look_at:
                self._check_alive(work.peer)
                look_at = now + _LOOK_S
            if moved:
                spin_until = now + spin_s
            elif now < spin_until:
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
        a ring can be missed; the nap's limit bounds what that costs. So does it the rare
        time two threads of one process sleep at once and the bell wakes only one.)"""
        self._say_sleeping(+1)
        try:
            try:
                os.read(self._bell_read, 1 << 16)  # a system call on a locked pipe: a memory fence too
            except BlockingIOError:
                pass
            if not self.progress():
                select.select([self._bell_read], [], [], max(0.0, min(seconds, _NAP_S)))
        finally:
            self._say_sleeping(-1)

    def _say_sleeping(self, change: int) -> None:
        """Count this thread in or out of the sleepers; the rings' flags are up while any sleeps."""
        with self._lock:
            self._sleepers += change
            if self._sleepers == (1 if change > 0 else 0):
                for channel in self._incoming.values():
                    channel.ring.set_receiver_sleeping(change > 0)

    def _check_alive(self, peer: int) -> None:
        pid, started = self._peers[peer]
        if start_time(pid) != started:
            raise TransportFailure(peer, f"rank {peer}'s process (pid {pid}) has exited")

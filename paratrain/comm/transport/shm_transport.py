"""The shared-memory transport: the processes of one host, messages through /dev/shm.

It is the third of paratrain's transports (beside the threads fabric and a torch.distributed
process group), chosen when a world or subgroup is made over a process group: where ranks share
this host and PARATRAIN_SHM allows it, `over_process_group` sets up rings between them
(shm_setup.py) and returns one of these; otherwise the process group's own transport.

Its `kind` is "shm" where every rank of the group shares this host: then every message of
paratrain's algorithms goes through shared memory, and `algo="auto"` picks from the shm column of
the algorithm table (choice.py). Where only some ranks share a host (several machines), messages
to those go through shared memory and the others through the process group; such a group's kind
is the process group's ("gloo"), which every rank agrees on, and `describe()` says which peers go
which way. The backend's own collectives ("native") always run on the process group.
"""

from __future__ import annotations

import functools

from paratrain.comm.transport import shm_setup
from paratrain.comm.transport.base import P2POp
from paratrain.comm.transport.shm import SharedMemoryP2P
from paratrain.comm.transport.torch_pg import TorchTransport
from paratrain.environment import Settings


def over_process_group(inner: TorchTransport, settings: Settings) -> TorchTransport | SharedMemoryTransport:
    """The transport for the process group of `inner`: shared memory to the ranks of this host
    where any two share one, else `inner` itself. Every rank of the group calls it (one
    all-gather), and every rank gets the same kind. Its subgroups are made the same way."""
    if inner.kind != "gloo":  # NCCL's tensors live on GPUs: nothing for shared memory to carry
        return inner
    inner.regroup = functools.partial(over_process_group, settings=settings)
    p2p = shm_setup.connect(inner, settings)
    return inner if p2p is None else SharedMemoryTransport(inner, p2p)


class SharedMemoryTransport:
    """A process group's ranks on this host, talking through shared-memory rings (`p2p`);
    `inner` (the process group) runs the backend's collectives and reaches other hosts."""

    def __init__(self, inner: TorchTransport, p2p: SharedMemoryP2P):
        self.inner, self.p2p = inner, p2p
        self.rank, self.size, self.global_ranks = inner.rank, inner.size, inner.global_ranks
        self.flight, self.device, self.staging = inner.flight, inner.device, inner.staging
        self.own_timeout = inner.own_timeout
        # All on this host: "shm" on every rank. Otherwise some ranks have no neighbour and run
        # a plain process group (kind "gloo"), so these say "gloo" too: algorithms must agree.
        self.kind = "shm" if len(p2p.neighbours) == self.size - 1 else inner.kind
        self.segment_bytes = inner.segment_bytes
        self.posts_ahead = True  # receives are matched by (source, tag), whenever posted
        self.arena = p2p.arena if self.kind == "shm" else None  # for algorithms/shared.py
        self.traffic = inner.traffic  # bytes to other hosts: they all go through the process group

    @property
    def hosts(self):
        return self.inner.hosts

    @property
    def host_names(self):
        return self.inner.host_names

    def describe(self) -> str:
        if self.kind == "shm":
            return f"shm: {self.size} processes of this host through /dev/shm (native collectives: gloo)"
        others = [r for r in range(self.size) if r != self.rank and r not in self.p2p.neighbours]
        return (f"{self.kind}: shared memory to ranks {list(self.p2p.neighbours)} of this host, "
                f"{self.inner.kind} to ranks {others}")

    def start(self, ops: list[P2POp]) -> list:
        """Post `ops`: to peers of this host through the rings, the rest on the process group."""
        return self.p2p.start(ops)

    def compile(self, schedule):
        """None: a replay goes through start(), since its messages go through the rings."""
        return None

    def torch_process_group(self, timeout: float):
        return self.inner.pg

    def split(self, ranks: list[int]):
        """This rank's transport in the subgroup of `ranks`: shared memory again where its
        members share a host (the process group's split regroups it)."""
        return self.inner.split(ranks)

    def split_with_everyone(self, ranks: list[int]):
        return self.inner.split_with_everyone(ranks)

    # The backend's own collectives: the process group's.

    def native_all_reduce(self, tensor, op, timeout):
        self.inner.native_all_reduce(tensor, op, timeout)

    def native_reduce_scatter(self, output, input, op, timeout):
        self.inner.native_reduce_scatter(output, input, op, timeout)

    def native_all_gather(self, output, input, timeout):
        self.inner.native_all_gather(output, input, timeout)

    def native_broadcast(self, tensor, root, timeout):
        self.inner.native_broadcast(tensor, root, timeout)

    def native_reduce(self, tensor, root, op, timeout):
        self.inner.native_reduce(tensor, root, op, timeout)

    def native_all_to_all(self, output, input, timeout, splits=None):
        self.inner.native_all_to_all(output, input, timeout, splits)

    def native_barrier(self, timeout):
        self.inner.native_barrier(timeout)

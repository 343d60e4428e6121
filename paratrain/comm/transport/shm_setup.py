"""Setting up shared memory (shm.py) for a process group: which of its ranks
share this host, and a ring to each of them.

Every rank of the group takes part (shm_transport.over_process_group calls `connect`): one
all-gather of (offers shared memory, host key, process id, random token), then, where any two
ranks share a host, two barriers. Between them each rank creates its outgoing rings and its
doorbell under /dev/shm, named by its token, and opens its peers'; after the second every peer
has opened them, so the names are removed: from then on a crash leaves no file behind.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import platform
import secrets

import torch

from paratrain.comm.transport.shm import SharedMemoryP2P, start_time
from paratrain.comm.transport.shm_ring import Ring, round_up
from paratrain.settings import Settings

DEFAULT_RING_BYTES = 4 << 20
# What one process's outgoing rings may hold together, unless PARATRAIN_SHM_BYTES says: a host
# of 64 ranks whose every pair talks (an all-to-all) would otherwise fill 16 GB of /dev/shm.
OUTGOING_BUDGET_BYTES = 64 << 20
LEAST_AUTO_RING_BYTES = 256 << 10
DEFAULT_SPIN_S = 0.05  # polling before sleeping, where each rank has a core: longer than a pipeline's waits


def enabled(settings: Settings) -> bool:
    """Whether this process offers shared memory to its peers (PARATRAIN_SHM, the platform)."""
    return settings.shm and platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


def ring_bytes(settings: Settings, neighbours: int = 1) -> int:
    """Each ring's size: PARATRAIN_SHM_BYTES, else DEFAULT_RING_BYTES while a process's rings
    to its `neighbours` fit OUTGOING_BUDGET_BYTES, less (down to LEAST_AUTO_RING_BYTES) beyond.
    Every rank of a host has the same number of neighbours, so both ends of a ring agree."""
    if settings.shm_bytes is not None:
        return round_up(settings.shm_bytes)
    return round_up(max(LEAST_AUTO_RING_BYTES, min(DEFAULT_RING_BYTES, OUTGOING_BUDGET_BYTES // max(neighbours, 1))))


def spin_s(settings: Settings, ranks_here: int) -> float:
    """How long a wait polls before it sleeps: PARATRAIN_SHM_SPIN_US, or DEFAULT_SPIN_S while
    this host has a core for each of its `ranks_here` ranks, and 0 when it has fewer: a polling
    rank would take the core of one that computes (Open MPI yields when idle on an
    oversubscribed host for the same reason)."""
    if settings.shm_spin_us is not None:
        return settings.shm_spin_us / 1e6
    ranks_here = max(ranks_here, settings.launch.local_world_size or 0)  # set by torchrun
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return DEFAULT_SPIN_S if ranks_here <= cores else 0.0


def _host_key() -> int:
    """Equal for processes that share /dev/shm and see each other's process ids: the boot,
    the /dev/shm file system and the process namespace."""
    with open("/proc/sys/kernel/random/boot_id", "rb") as handle:
        boot = handle.read().strip()
    shm = os.stat("/dev/shm")
    namespace = os.readlink("/proc/self/ns/pid")
    digest = hashlib.blake2b(b"|".join([boot, str(shm.st_dev).encode(), namespace.encode()]), digest_size=7)
    return int.from_bytes(digest.digest(), "little")


def _ring_path(token: int, dst: int) -> str:
    return f"/dev/shm/paratrain-{token:016x}-to-{dst}"


def _bell_path(token: int) -> str:
    return f"/dev/shm/paratrain-{token:016x}-bell"


def connect(inner, settings: Settings) -> SharedMemoryP2P | None:
    """Set up shared memory among the ranks of `inner` (a TorchTransport) that share a host; every rank
    calls this (one all-gather, and two barriers where any two ranks share a host). Returns
    None where this rank shares a host with none of the others (or offers no shared memory)."""
    me = torch.zeros(4, dtype=torch.int64)
    offered = enabled(settings)
    token = secrets.randbits(62)
    if offered:
        try:
            me[:] = torch.tensor([1, _host_key(), os.getpid(), token])
        except OSError:  # no /proc: not a Linux we know how to watch
            offered = False
    everyone = torch.empty(inner.size * 4, dtype=torch.int64)
    timeout = inner.own_timeout or settings.timeout
    inner.native_all_gather(everyone, me, timeout)
    table = everyone.view(inner.size, 4).tolist()
    hosts = {}
    for rank, (offers, key, _, _) in enumerate(table):
        if offers:
            hosts.setdefault(key, []).append(rank)
    if all(len(ranks) < 2 for ranks in hosts.values()):
        return None  # the same answer on every rank: nobody does the barriers below
    neighbours = [r for r in hosts.get(table[inner.rank][1], []) if r != inner.rank] if offered else []
    capacity = ring_bytes(settings, len(neighbours))
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
    peers = {peer: (table[peer][2], start_time(table[peer][2])) for peer in neighbours}
    return SharedMemoryP2P(inner, outgoing, incoming, bells, bell, peers, spin_s(settings, len(neighbours) + 1))


def _unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

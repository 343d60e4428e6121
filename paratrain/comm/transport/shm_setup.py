"""Setting up shared memory (shm.py) for a process group: which of its ranks
share this host, and a ring to each of them.

Every rank of the group takes part (shm_transport.over_process_group calls `connect`): one
all-gather of (offers shared memory, host key, process id, random token, parent's process id,
host name), which also tells the process group which of its ranks share a host (`know_hosts`),
then, where any two ranks share a host, two barriers. Between them each rank creates its
outgoing rings and its doorbell under /dev/shm (or PARATRAIN_SHM_DIR: a container's /dev/shm
may be small), and opens its peers'; after the second every
peer has opened them, so the names are removed: from then on a crash leaves no file behind.

Where every rank of the group shares this host, the group's rank 0 also creates the group's
shared segment for the collectives (shm_arena.py) before the first barrier, and the others
map it after it.

A rank killed between the barriers cannot remove its files, so their names say whose they are:
/dev/shm/paratrain-<pid namespace>-<parent pid>-<pid>-<token>-to-<peer> (and -bell, -arena). Our
launcher, the parent, removes its ranks' files once they have exited; and every rank setting
up removes, naming them, the files of a process of its namespace that no longer exists (a run
under torchrun whose ranks were killed, or whose launcher was).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import platform
import re
import secrets
import sys

import torch

from paratrain.comm import native
from paratrain.comm.transport.shm import SharedMemoryP2P
from paratrain.comm.transport.shm_arena import Arena
from paratrain.comm.transport.shm_ring import Ring, round_up
from paratrain.lifetime import process_alive, start_time
from paratrain.environment import Settings

DEFAULT_RING_BYTES = 4 << 20
# What one process's outgoing rings may hold together, unless PARATRAIN_SHM_BYTES says: a host
# of 64 ranks whose every pair talks (an all-to-all) would otherwise fill 16 GB of /dev/shm.
OUTGOING_BUDGET_BYTES = 64 << 20
LEAST_AUTO_RING_BYTES = 256 << 10
DEFAULT_SPIN_S = 0.05  # polling before sleeping, where each rank has a core: longer than a pipeline's waits


def enabled(settings: Settings) -> bool:
    """Whether this process offers shared memory to its peers (PARATRAIN_SHM, the platform)."""
    return settings.shm and platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(settings.shm_dir)


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


def _host_key(settings: Settings) -> int:
    """Equal for processes that share the folder of shared memory (PARATRAIN_SHM_DIR) and see
    each other's process ids (the boot, the folder's file system and name, the process
    namespace) and give their host the same name: ranks told different names (PARATRAIN_HOST)
    are on different hosts, even on one machine."""
    parts = [settings.host_name.encode(), settings.shm_dir.encode()]
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as handle:
            parts.append(handle.read().strip())
        parts += [str(os.stat(settings.shm_dir).st_dev).encode(), os.readlink("/proc/self/ns/pid").encode()]
    except OSError:  # no /proc (or no such folder): the names alone tell hosts apart
        pass
    digest = hashlib.blake2b(b"|".join(parts), digest_size=7)
    return int.from_bytes(digest.digest(), "little")


# What each rank says of itself at setup: offers shared memory, host, pid, token, parent pid, has
# the native kernels; then its host's name, _NAME_BYTES of UTF-8 (cut longer: the key tells hosts apart).
_FIELDS = 6
_NAME_BYTES = 64
_FILE_NAME = re.compile(r"^paratrain-(\d+)-(\d+)-(\d+)-[0-9a-f]{16}-(to-\d+|bell|arena)$")  # namespace, parent, pid


def _owner(folder: str, namespace: int, parent: int, pid: int, token: int) -> str:
    """The start of the names of a process's files in `folder` (PARATRAIN_SHM_DIR)."""
    return f"{folder}/paratrain-{namespace}-{parent}-{pid}-{token:016x}"


def _ring_path(owner: str, dst: int) -> str:
    return f"{owner}-to-{dst}"


def _bell_path(owner: str) -> str:
    return f"{owner}-bell"


def _arena_path(owner: str) -> str:
    return f"{owner}-arena"


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def remove_stale_files(folder: str) -> None:
    """Remove the rings and doorbells in `folder` (PARATRAIN_SHM_DIR) of processes of this
    namespace that no longer exist, one line each on stderr. Ranks of a host sweep together:
    each file is removed (and named) by one of them."""
    for path, pid, kind in _our_files(folder, lambda parent, pid: not process_alive(pid)):
        if _unlink_one(path):
            # One write per line: the ranks of a host sweep at the same moment into one stream.
            sys.stderr.write(f"removed stale shared-memory {kind} {path} left by dead process {pid}\n")


def remove_files_of_children(parent: int, folder: str) -> None:
    """Remove the files in `folder` the ranks that `parent` launched left (they have exited:
    those killed while setting up could not remove their own)."""
    for path, _, _ in _our_files(folder, lambda owner_parent, pid: owner_parent == parent):
        _unlink_one(path)


def _our_files(folder: str, chosen):
    """(path, pid, "ring", "doorbell" or "segment") of each of our files in `folder` of this pid
    namespace for which chosen(parent pid, pid) holds."""
    if not os.path.isdir(folder):
        return
    namespace, me = _pid_namespace(), os.getuid()
    for name in os.listdir(folder):
        match = _FILE_NAME.match(name)
        if match and int(match[1]) == namespace and _owner_of(f"{folder}/{name}") == me and \
                chosen(int(match[2]), int(match[3])):
            kind = {"bell": "doorbell", "arena": "segment"}.get(match[4], "ring")
            yield f"{folder}/{name}", int(match[3]), kind


def _owner_of(path: str) -> int | None:
    try:
        return os.lstat(path).st_uid
    except OSError:
        return None


def _unlink_one(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:  # removed by another rank sweeping
        return False
    except PermissionError:  # another user's (/dev/shm is sticky): theirs to remove, never ours
        return False
    return True


def _exchange_offers(inner, settings: Settings, timeout: float) -> tuple[bool, object, list[list[int]], list[str]]:
    """What this rank offers (shared memory at all, its host, pid, a token, its launcher, the
    native kernels loaded) and its host's name, gathered from every rank of `inner`: (offered,
    kernels, the table of every rank's _FIELDS, every rank's host name)."""
    words = _FIELDS + _NAME_BYTES // 8
    me = torch.zeros(words, dtype=torch.int64)
    me[1] = _host_key(settings)
    name = settings.host_name.encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
    me[_FIELDS:] = torch.frombuffer(bytearray(name), dtype=torch.int64)
    offered = enabled(settings)
    kernels = None
    if offered:
        try:
            me[0], me[2:5] = 1, torch.tensor([os.getpid(), secrets.randbits(62),
                                              settings.launch.launcher_pid or os.getppid()])
        except OSError:  # no /proc: not a Linux we know how to watch
            offered = False
    if offered and settings.native and inner.size > 1:
        kernels, _ = native.load(settings.cache_dir, settings.cc)
        me[5] = kernels is not None
    everyone = torch.empty(inner.size * words, dtype=torch.int64)
    inner.native_all_gather(everyone, me, timeout)
    rows = everyone.view(inner.size, words)
    names = [bytes(row[_FIELDS:].numpy().tobytes()).rstrip(b"\0").decode(errors="replace") for row in rows]
    return offered, kernels, rows[:, :_FIELDS].tolist(), names


def _by_host(keys: list[int]) -> tuple[tuple[int, ...], ...]:
    """The ranks of each host, hosts in the order of their first rank."""
    hosts: dict[int, list[int]] = {}
    for rank, key in enumerate(keys):
        hosts.setdefault(key, []).append(rank)
    return tuple(tuple(ranks) for ranks in hosts.values())


def connect(inner, settings: Settings) -> SharedMemoryP2P | None:
    """Set up shared memory among the ranks of `inner` (a TorchTransport) that share a host; every rank
    calls this (one all-gather, and two barriers where any two ranks share a host). Returns
    None where this rank shares a host with none of the others (or offers no shared memory);
    the returned transport's `arena` is the group's shared segment where all of them do (else None)."""
    timeout = inner.own_timeout or settings.timeout
    offered, kernels, table, names = _exchange_offers(inner, settings, timeout)
    inner.know_hosts(_by_host([row[1] for row in table]), tuple(names))
    hosts = {}
    for rank, (offers, key, *_) in enumerate(table):
        if offers:
            hosts.setdefault(key, []).append(rank)
    if all(len(ranks) < 2 for ranks in hosts.values()):
        return None  # the same answer on every rank: nobody does the barriers below
    neighbours = [r for r in hosts.get(table[inner.rank][1], []) if r != inner.rank] if offered else []
    capacity = ring_bytes(settings, len(neighbours))
    everyone_here = len(neighbours) == inner.size - 1  # the same answer on every rank (see above)
    owners, mine = {}, []
    if neighbours:
        remove_stale_files(settings.shm_dir)
        namespace = _pid_namespace()  # the same for the ranks of a host (see _host_key)
        owners = {r: _owner(settings.shm_dir, namespace, table[r][4], table[r][2], table[r][3])
                  for r in (inner.rank, *neighbours)}
        own = owners[inner.rank]
        mine = [_ring_path(own, peer) for peer in neighbours] + [_bell_path(own)]
        if everyone_here and inner.rank == 0:
            mine.append(_arena_path(own))
    cleanup = functools.partial(_unlink, mine)
    atexit.register(cleanup)  # only if we fail before the second barrier below
    outgoing, incoming, bells, bell, arena = {}, {}, {}, None, None
    peers = {peer: (table[peer][2], start_time(table[peer][2])) for peer in neighbours}
    ranks_here = len(neighbours) + 1
    if neighbours:
        outgoing = {peer: Ring(_ring_path(own, peer), capacity, create=True) for peer in neighbours}
        if everyone_here and inner.rank == 0:
            arena = Arena.open(_arena_path(own), inner.size, 0, True, peers, spin_s(settings, ranks_here))
        os.mkfifo(_bell_path(own), 0o600)
        bell = (os.open(_bell_path(own), os.O_RDONLY | os.O_NONBLOCK),
                os.open(_bell_path(own), os.O_WRONLY | os.O_NONBLOCK))
    inner.native_barrier(timeout)  # every ring and doorbell exists
    for peer in neighbours:
        incoming[peer] = Ring(_ring_path(owners[peer], inner.rank), capacity, create=False)
        bells[peer] = os.open(_bell_path(owners[peer]), os.O_WRONLY | os.O_NONBLOCK)
    if everyone_here and inner.rank != 0:
        arena = Arena.open(_arena_path(owners[0]), inner.size, inner.rank, False, peers, spin_s(settings, ranks_here))
    inner.native_barrier(timeout)  # every peer has opened ours: the names can go
    cleanup()
    atexit.unregister(cleanup)
    if not neighbours:
        return None
    p2p = SharedMemoryP2P(inner, outgoing, incoming, bells, bell, peers, spin_s(settings, ranks_here))
    if arena is not None:
        arena.progress = p2p.progress  # a peer blocked on a full ring to us must be read while we wait
        arena.bell, arena.ring = bell[0], p2p.ring_bell  # a long wait sleeps on the rings' doorbell
        # Native code only where every rank has it: then all of them reduce alike, to the same bits.
        arena.native = kernels if all(row[5] for row in table) else None
    p2p.arena = arena
    p2p.kernels = kernels  # the rings' short cut reads and writes the same bytes either way
    return p2p


def _unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

"""Reading a peer process's memory straight into ours: Linux's process_vm_readv (cross-memory
attach, "CMA"), one copy where the shared segment takes two (into a slot, out of it).

MPICH and Open MPI move large messages between the processes of one host this way. The kernel
allows it where it would allow ptrace: the same user, and no Yama or container rule against it.
Whether it is allowed is found out once per segment by every rank of the group together (`agree`):
each publishes the address of a word it holds, tries to read every peer's, and the group uses it
only if every rank could, so that every rank takes the same path in every call.

Used by the all-to-alls of algorithms/shared.py for parts larger than a slot: each rank reads its
part of every peer's input into its output, between two steps (the inputs' addresses published;
every rank has read).
"""

from __future__ import annotations

import ctypes
import os
import sys

_MAGIC = 0x0DDBA11C0FFEE  # what each rank's probe word holds


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _process_vm_readv():
    """libc's process_vm_readv, typed; None off Linux or where libc lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_ssize_t
    call.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                     ctypes.c_ulong]
    return call


class CrossMemory:
    """Reads from the processes of a group's ranks (`pids`: rank -> pid)."""

    def __init__(self, call, pids: dict[int, int]):
        self._call, self._pids = call, pids
        self._local, self._remote = _IoVec(), _IoVec()

    def read(self, peer: int, into: int, address: int, nbytes: int) -> None:
        """nbytes at `address` in rank `peer`'s process to `into` in ours."""
        local, remote = self._local, self._remote
        while nbytes > 0:  # the kernel may read less than asked (a partial transfer)
            local.base, local.length, remote.base, remote.length = into, nbytes, address, nbytes
            done = self._call(self._pids[peer], ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if done <= 0:
                error = ctypes.get_errno()
                raise OSError(error, f"reading {nbytes} bytes of rank {peer}'s memory (process_vm_readv): "
                                     f"{os.strerror(error)}")
            into, address, nbytes = into + done, address + done, nbytes - done


def agree(arena, timeout: float) -> CrossMemory | None:
    """Whether every rank of the arena's group can read every peer's memory: a CrossMemory if so,
    else None. Every rank calls it at the same point (it takes two steps of the segment)."""
    call = _process_vm_readv()
    probe = ctypes.c_int64(_MAGIC)
    half = arena.next_half()
    arena.write_words(half, [ctypes.addressof(probe)])
    arena.arrive_and_wait(timeout)
    addresses = [words[0] for words in arena.read_words(half, 1)]
    pids = {peer: pid for peer, (pid, _) in arena.peers.items()}
    reader = CrossMemory(call, pids) if call is not None else None
    able = reader is not None
    for peer in pids:
        if not able:
            break
        seen = ctypes.c_int64(0)
        try:
            reader.read(peer, ctypes.addressof(seen), addresses[peer], 8)
        except OSError:
            able = False
        able = able and seen.value == _MAGIC
    half = arena.next_half()
    arena.write_words(half, [int(able)])
    arena.arrive_and_wait(timeout)  # every rank has read our probe: it may go
    everyone = all(words[0] for words in arena.read_words(half, 1))
    return reader if everyone else None


def reader_of(arena, timeout: float) -> CrossMemory | None:
    """What reads the arena's group's peers' memory, where every rank of it may (found out by all
    of them together at the first call that asks, `agree`), else None."""
    if arena.cross_memory is None:  # (a segment of our own, Arena.alone, has no peers to read)
        whole = len(arena.peers) == arena.size - 1
        arena.cross_memory = (whole and agree(arena, timeout)) or False
    return arena.cross_memory or None


def publish_input(arena, address: int, timeout: float) -> list[int]:
    """A step after which every rank's input is ready: the address of each rank's, rank by rank."""
    half = arena.next_half()
    arena.write_words(half, [address])
    arena.arrive_and_wait(timeout)
    return [words[0] for words in arena.read_words(half, 1)]


def all_have_read(arena, timeout: float) -> None:
    """A step after which no rank reads another's input any more: each may return (and change it)."""
    arena.next_half()
    arena.arrive_and_wait(timeout)

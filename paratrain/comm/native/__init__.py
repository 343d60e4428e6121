"""Native code for the shared segment's collectives (arena_kernels.c), built on first use.

The C file is a Python extension module, compiled with the host's C compiler (`cc`, or the
settings' CC) and this Python's headers into paratrain's cache folder, named by a hash of its
source, flags and the interpreter's ABI, so every process of a host loads the same module and a
changed source builds anew. Two processes building at once each write their own file and rename
it into place. Where no compiler or headers are found or the build fails, `load` says why and
the collectives run through torch's ops instead (shared.py), as they do with PARATRAIN_NATIVE=0.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("arena_kernels.c")
MODULE = "_arena_kernels"  # the name its PyInit_ function carries
# -O3 vectorizes the folds; no -ffast-math, so each add is the IEEE add torch's is (the same bits).
FLAGS = ("-O3", "-fPIC", "-shared", "-std=gnu11")
MOST_ROWS = 64  # arena_kernels.c's MOST_ROWS: a plan reads at most this many rows
DTYPES = {torch.float32: 0, torch.float64: 1, torch.int32: 2, torch.int64: 3}
DONE, WAIT, WAIT_AND_RING, CHANGED = 0, 1, 2, 3


class Copy(ctypes.Structure):
    """arena_kernels.c's struct copy."""

    _fields_ = [("into", ctypes.c_void_p), ("source", ctypes.c_void_p), ("bytes", ctypes.c_int64)]


class PeerRead(ctypes.Structure):
    """arena_kernels.c's struct peer_read: `bytes` of process `pid` from the address it published
    in the word at `published`, plus `offset`, into `into`."""

    _fields_ = [("into", ctypes.c_void_p), ("published", ctypes.c_void_p), ("offset", ctypes.c_int64),
                ("bytes", ctypes.c_int64), ("pid", ctypes.c_int64)]


class OneShotPlan(ctypes.Structure):
    """arena_kernels.c's struct oneshot_plan: one call's addresses, worked out once."""

    _fields_ = [("slot", ctypes.c_void_p), ("input", ctypes.c_void_p), ("copy_bytes", ctypes.c_int64),
                ("words", ctypes.c_void_p), ("mine", ctypes.c_int64), ("peers", ctypes.c_int64 * MOST_ROWS),
                ("npeers", ctypes.c_int64), ("out", ctypes.c_void_p), ("rows", ctypes.c_void_p * MOST_ROWS),
                ("nrows", ctypes.c_int64), ("count", ctypes.c_int64), ("dtype", ctypes.c_int64),
                ("before", ctypes.c_int64), ("after", ctypes.c_int64), ("copies", ctypes.c_void_p),
                ("nreads", ctypes.c_int64), ("reads", ctypes.c_void_p),
                ("nchecks", ctypes.c_int64), ("checks", ctypes.c_void_p)]

    def set_copies(self, before: list[tuple[int, int, int]], after: list[tuple[int, int, int]]) -> None:
        """The (into, from, bytes) copies made before the step and after it."""
        self.before, self.after = len(before), len(after)
        self.copies = self._kept("copies", Copy, [*before, *after])

    def set_checks(self, checks: list[tuple[int, int, int]]) -> None:
        """The (at, expected, bytes) that must hold after the step for the rest of the plan to run:
        where one does not, the kernel returns CHANGED having done nothing after the step."""
        self.nchecks = len(checks)
        self.checks = self._kept("checks", Copy, checks)

    def set_reads(self, reads: list[tuple[int, int, int, int, int]]) -> None:
        """The (into, published, offset, bytes, pid) reads of peers' memory made after the copies."""
        self.nreads = len(reads)
        self.reads = self._kept("reads", PeerRead, reads)

    def _kept(self, name: str, kind, rows: list[tuple]) -> int:
        """The address of an array of `kind` holding `rows`, kept on this plan as long as it
        points at it (NULL, 0, where there are none)."""
        array = (kind * len(rows))(*rows) if rows else None
        setattr(self, f"_{name}_array", array)
        return ctypes.addressof(array) if array is not None else 0


@dataclass(frozen=True)
class Kernels:
    """The loaded module: `oneshot(plan_address, step, poll_ns)`, and `finish(plan_address)` for
    the rest of a plan (reduction, copies, reads) whose oneshot returned before its peers
    arrived; both return DONE, CHANGED (a check failed: nothing after the step was done) or
    minus the errno of a read of a peer's memory that failed; `ring_put`,
    `ring_poll` and `ring_take` for the rings' blocking short cut (transport/shm.py)."""

    path: Path
    oneshot: object
    finish: object
    ring_put: object
    ring_poll: object
    ring_take: object


def _compiler(named: str | None) -> str | None:
    return named or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def library_path(cache_dir: str) -> Path:
    """Where the module built from this source, with these flags, for this Python lives here."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + suffix.encode()
                         + platform.machine().encode())
    return Path(cache_dir).expanduser() / "paratrain" / "native" / f"arena_kernels-{key.hexdigest()[:16]}{suffix}"


def build(cache_dir: str, compiler: str | None = None) -> Path:
    """The module, compiled (by `compiler`, else the first of cc, gcc, clang) if it is not in
    the cache yet. Raises OSError saying why it cannot be."""
    target = library_path(cache_dir)
    if target.exists():
        return target
    compiler = _compiler(compiler)
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or clang; or set CC)")
    headers = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(headers, "Python.h")):
        raise OSError(f"no Python.h in {headers} (the Python headers: python3-dev)")
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(handle)
    try:
        done = subprocess.run([compiler, *FLAGS, f"-I{headers}", "-o", partial, str(SOURCE)], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            said = done.stderr.strip().splitlines()
            raise OSError(f"{compiler} failed (exit code {done.returncode})" + (f": {said[-1]}" if said else ""))
        os.replace(partial, target)  # another process building at once renames the same bytes
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.lru_cache(maxsize=None)
def load(cache_dir: str, compiler: str | None = None) -> tuple[Kernels | None, str]:
    """The kernels, or None and why not (the reason is shown by `paratrain env`). Once per
    process: every group's setup asks (a mesh makes one per axis)."""
    if platform.machine() not in ("x86_64", "AMD64"):  # the step's store order is x86-64's (shm_arena.py)
        return None, f"no native kernels for {platform.machine()}"
    try:
        path = build(cache_dir, compiler)
        loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(MODULE, path, loader=loader))
        loader.exec_module(module)
    except (OSError, ImportError, subprocess.SubprocessError) as error:
        return None, f"native kernels not built: {error}"
    return Kernels(path, module.oneshot, module.finish, module.ring_put, module.ring_poll, module.ring_take), \
        f"native kernels: {path}"

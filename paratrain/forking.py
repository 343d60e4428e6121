"""Child processes forked from a server that imported torch once.

A process that starts fresh spends about 1.5 s of CPU importing torch before it does anything.
A world of N ranks spawned fresh pays that N times, a frontend with N workers N + 1 times, and on
a machine with few cores the ranks queue for them. Python's *forkserver* start method starts
one server process, which imports the modules named here once, and forks each child from it:
the child begins with torch already imported, in milliseconds. The server holds no threads
(forking a process with threads is unsafe) and exits with the process that started it.

Two things a forked child does not get the way a spawned one does, set right here:
- the environment: the child has the server's (the parent's as it was when the server started);
  `in_environment` puts the parent's environment as it is now in place first;
- torch's thread count, which OpenMP read from OMP_NUM_THREADS when the server loaded torch:
  set again from the environment the child is given.
Standard output and error are the parent's as they are now (`ParentStdio`), not as they were
when the server started (pytest, for one, points them at a new file for each test).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys

from paratrain.settings import take_environment, threads_from_environment

# Imported once, in the server; each child starts with them. `paratrain.launch` brings torch,
# torch.distributed and our communication layer; the rest is what a frontend dispatcher and its
# workers run. (Not torch._dynamo, which a dispatcher's first shape inference imports: it makes
# torch's compile cache folder in the temp directory, and nothing else here needs it.)
PRELOAD = ("torch", "paratrain.launch", "paratrain.cli", "paratrain.frontend.cli",
           "paratrain.frontend.dispatcher.serve", "paratrain.frontend.workers.worker")

def forkserver_context():
    """The forkserver start method, with PRELOAD, where the platform forks; else None (spawn)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    # Start the server now (it preloads while the caller goes on), and so its socket is made
    # in the temp directory of now: the launcher points tempfile at a folder it later removes.
    multiprocessing.forkserver.ensure_running()
    return context


def start_method() -> str:
    """For launchers that take a name (PyTorch's elastic agent): forkserver where possible."""
    return "forkserver" if forkserver_context() is not None else "spawn"


class ParentStdio:
    """Pickled into a forked child's arguments: the parent's standard output and error as they
    are at that moment, sent as file descriptors, which the child then writes to."""

    def __reduce__(self):
        from multiprocessing import context, reduction

        if context.get_spawning_popen() is None:  # pickled for anything but starting a process
            return (_keep_stdio, ())
        sys.stdout.flush()
        sys.stderr.flush()
        return (_adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2)))


def _keep_stdio():
    return None


def _adopt_stdio(stdout, stderr):
    for wrapped, target in ((stdout, 1), (stderr, 2)):
        fd = wrapped.detach()
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    return None


def adopt_environment(parent_environ: dict[str, str]) -> None:
    """In a forked child: the parent's environment, plus what the child's starter set for it;
    torch's threads as that environment says."""
    take_environment(parent_environ, keep_set_since_import=True)
    threads = threads_from_environment()
    if threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def run_command(environ: dict[str, str], argv: list[str]) -> None:
    """A forked child that behaves like `python -m paratrain ARGV` started with `environ`."""
    take_environment(environ)
    sys.argv = ["paratrain", *argv]  # runpy puts the module's path first
    runpy.run_module("paratrain", run_name="__main__", alter_sys=True)

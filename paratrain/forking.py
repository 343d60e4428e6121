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
Standard output and error are the parent's as they are now (`Stdio`), not as they were
when the server started (pytest, for one, points them at a new file for each test). What torch
reads from the environment as it is imported (inductor's compiler CXX, TORCHINDUCTOR_* settings)
stays as it was when the server started: a variable changed since takes a new interpreter.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

from paratrain.environment import take_environment, threads_from_environment

# Imported once, in the server; each child starts with them. `paratrain.launch` brings torch,
# torch.distributed and our communication layer; the rest is what a frontend dispatcher and its
# workers run. torch._dynamo too: PyTorch imports it on the first operation on meta tensors (a
# dispatcher's first shape inference), on the first compile and in a training rank's first steps,
# seconds of CPU each time: once per server instead of once per child. (Its import makes torch's compile cache folder,
# torchinductor_<user>, in the temp directory, where torch would make it on a first compile.)
PRELOAD = ("torch", "torch._dynamo", "paratrain.launch", "paratrain.cli", "paratrain.frontend.cli",
           "paratrain.frontend.dispatcher.serve", "paratrain.frontend.workers.worker")

def forkserver_context():
    """The forkserver start method, with PRELOAD, where the platform forks; else None (spawn)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    context = multiprocessing.get_context("forkserver")
    if _ask_the_server_we_came_from():
        return context
    context.set_forkserver_preload(list(PRELOAD))
    # Start the server now (it preloads while the caller goes on), and so its socket is made
    # in the temp directory of now: the launcher points tempfile at a folder it later removes.
    multiprocessing.forkserver.ensure_running()
    return context


def _ask_the_server_we_came_from() -> bool:
    """In a process forked from a server (a command, a rank): have that server fork its children
    too, rather than start a server of its own, which imports PRELOAD again (6 s of CPU here, for
    each `train --launcher processes` run as a forked command). Such a process holds the server's
    address and a copy of the pipe that keeps it alive, but no pid of it to poll, so
    multiprocessing would start a new one: told the server runs, it connects to the one it has.
    (multiprocessing's own attributes, as Python 3.8 to 3.13 name them; elsewhere a server of its
    own, as before.)"""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", 0) is not None:
        return False  # this process started its server, or has none to ask
    if getattr(server, "_forkserver_address", None) is None or getattr(server, "_forkserver_alive_fd", None) is None:
        return False
    from multiprocessing import resource_tracker

    server.ensure_running = resource_tracker.ensure_running  # the tracker's pipe came with the fork, too
    return True


def start_method() -> str:
    """For launchers that take a name (PyTorch's elastic agent): forkserver where possible."""
    return "forkserver" if forkserver_context() is not None else "spawn"


class Stdio:
    """Pickled into a forked child's arguments: file descriptors of the parent, as they are at
    that moment (default: its standard output and error), that become the child's 1 and 2."""

    def __init__(self, stdout: int = 1, stderr: int = 2):
        self.stdout, self.stderr = stdout, stderr

    def __reduce__(self):
        from multiprocessing import context, reduction

        if context.get_spawning_popen() is None:  # pickled for anything but starting a process
            return (_keep_stdio, ())
        sys.stdout.flush()
        sys.stderr.flush()
        return (_adopt_stdio, (reduction.DupFd(self.stdout), reduction.DupFd(self.stderr)))


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


def run_command(environ: dict[str, str], argv: list[str], stdio: Stdio | None = None) -> None:
    """A forked child that behaves like `python -m paratrain ARGV` started with `environ`."""
    del stdio  # unpickling it pointed this process's output where the parent asked
    multiprocessing.current_process().daemon = False  # it may start processes of its own (workers)
    take_environment(environ)
    sys.argv = ["paratrain", *argv]  # runpy puts the module's path first
    runpy.run_module("paratrain", run_name="__main__", alter_sys=True)


def start_command(argv: list[str], environ: dict[str, str], *, capture_stdout: bool = False,
                  stderr: int | None = None):
    """`python -m paratrain ARGV` as a child of this process: forked from the server where the
    platform forks (a ForkedCommand), else spawned (a subprocess.Popen). Either answers as a
    Popen does; with `capture_stdout`, `.stdout` reads its standard output as text. `stderr`
    as Popen takes it: None (ours), subprocess.PIPE (then `.stderr` reads it), subprocess.STDOUT,
    or a file."""
    context = forkserver_context()
    if context is None:
        return subprocess.Popen([sys.executable, "-m", "paratrain", *argv], env=environ, text=True,
                                stdout=subprocess.PIPE if capture_stdout else None, stderr=stderr)
    return ForkedCommand(context, argv, environ, capture_stdout, stderr)


class ForkedCommand:
    """A command forked from the server, with the face of the subprocess.Popen it stands for:
    pid, poll(), wait(), communicate(), send_signal(), terminate(), kill(), returncode, stdout, stderr. It is a
    daemon of this process: when this process exits, multiprocessing stops it (SIGTERM), as it
    would be told to anyway."""

    def __init__(self, context, argv: list[str], environ: dict[str, str], capture_stdout: bool,
                 stderr: int | None = None):
        self.args = ["paratrain", *argv]
        pipes = []  # (our read end, the child's write end)
        if capture_stdout:
            pipes.append(os.pipe())
        if stderr == subprocess.PIPE:
            pipes.append(os.pipe())
        child_stdout = pipes[0][1] if capture_stdout else 1
        child_stderr = (pipes[-1][1] if stderr == subprocess.PIPE else 2 if stderr is None
                        else child_stdout if stderr == subprocess.STDOUT else _fileno(stderr))
        self._process = context.Process(target=run_command, args=(environ, argv, Stdio(child_stdout, child_stderr)),
                                        name=" ".join(self.args[:2]), daemon=True)
        try:
            with _main_module_hidden():
                self._process.start()
        finally:
            for _, write_end in pipes:
                os.close(write_end)  # the child holds its own copy: its exit ends our reads
        self.pid = self._process.pid
        self.stdout = os.fdopen(pipes[0][0], "r") if capture_stdout else None
        self.stderr = os.fdopen(pipes[-1][0], "r") if stderr == subprocess.PIPE else None

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Read the captured streams to their end and wait for the exit; -> (stdout, stderr).
        One thread per stream, as a full pipe of one must not stop the other."""
        read: dict[str, str] = {}

        def read_all(name: str, stream) -> None:
            read[name] = stream.read()

        readers = [threading.Thread(target=read_all, args=(name, stream), daemon=True)
                   for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)) if stream is not None]
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.1))
        return read.get("stdout"), read.get("stderr")

    def send_signal(self, signal_number: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signal_number)

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()


def _fileno(target) -> int:
    return target if isinstance(target, int) else target.fileno()


@contextmanager
def _main_module_hidden():
    """multiprocessing has each child import the parent's main module first (so that functions
    defined there unpickle). A command needs nothing of it, and a program with no `__main__`
    guard (a GT script, which auto-starts its server) would run again in the child: so the main
    module's path and name are hidden while the child starts."""
    main = sys.modules.get("__main__")
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if main is not None and name in main.__dict__}
    if "__file__" in saved:
        del main.__file__
    if "__spec__" in saved:
        main.__spec__ = None  # multiprocessing reads it unguarded
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)

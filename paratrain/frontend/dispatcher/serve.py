"""`paratrain serve`: a dispatcher, with its workers or without.

Without `local_workers` the workers join from anywhere with `paratrain worker --host H --port P`
(under torchrun they keep torchrun's world). With it, each worker is a process started here
that joins the same way and forms the world through the store the dispatcher hosts. (Not
PyTorch's elastic launcher: it treats one worker's exit as the whole group's failure and stops
the rest, while a dispatcher serves on when a worker is lost.) A worker process that exits is
reported as lost, at once, with how it ended.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys

from paratrain import forking
from paratrain.frontend.dispatcher.dispatcher import Dispatcher
from paratrain.frontend.dispatcher.serve_options import DispatcherSettings
from paratrain.frontend.processes import describe_exit
from paratrain.lifetime import process_alive
from paratrain.frontend.protocol.addresses import READY_MARK
from paratrain.environment import child_environment


def default_threads(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


class LocalWorkers:
    """`paratrain worker` processes on this machine, one per worker.

    On Linux they are forked from this process before the dispatcher exists: no thread runs yet
    (forking a process with threads is unsafe), and each worker starts with torch and the
    frontend already imported instead of spending seconds importing them. Each waits on a pipe
    for the dispatcher's address, known once it listens (`tell`). Elsewhere they are spawned as
    `python -m paratrain worker` once the address is known."""

    def __init__(self, count: int, token: str | None, threads: int):
        self.count, self.token, self.threads = count, token, threads
        self.processes: list = []
        self.reported: set[int] = set()
        self._address_pipes: list[int] = []
        if _can_fork():
            pipes = [os.pipe() for _ in range(count)]
            every_end = [fd for pipe in pipes for fd in pipe]
            fork = multiprocessing.get_context("fork")
            for local_rank, (read_end, _) in enumerate(pipes):
                others = [fd for fd in every_end if fd != read_end]
                process = fork.Process(target=_worker_once_told, name=f"worker{local_rank}",
                                       args=(read_end, others, self._environment(local_rank), self._options()))
                process.start()
                self.processes.append(process)
            for read_end, write_end in pipes:
                os.close(read_end)
                self._address_pipes.append(write_end)

    def tell(self, address: str) -> None:
        """The dispatcher listens at `address`: the workers may join it."""
        host, _, port = address.rpartition(":")
        if not self.processes:
            for local_rank in range(self.count):
                command = [sys.executable, "-m", "paratrain", "worker", "--host", host, "--port", port, *self._options()]
                self.processes.append(_Spawned(subprocess.Popen(command, env=self._environment(local_rank))))
        for fd in self._address_pipes:
            os.write(fd, f"{host} {port}\n".encode())
            os.close(fd)
        self._address_pipes = []

    def _environment(self, local_rank: int) -> dict[str, str]:
        env = child_environment(OMP_NUM_THREADS=str(self.threads), LOCAL_RANK=str(local_rank))
        if self.token:
            env["PARATRAIN_TOKEN"] = self.token
        return env

    def _options(self) -> list[str]:
        return ["--threads", str(self.threads), "--exit-with-pid", str(os.getpid())]

    def exited(self) -> list[tuple[int, str]]:
        """(pid, how it ended) of each worker process that has exited since the last call."""
        ended = []
        for process in self.processes:
            code = process.exitcode
            if code is not None and process.pid not in self.reported:
                self.reported.add(process.pid)
                ended.append((process.pid, describe_exit(code)))
        return ended

    def stop(self, timeout: float = 10.0) -> None:
        for fd in self._address_pipes:  # never told: they read the end of the pipe and leave
            os.close(fd)
        self._address_pipes = []
        for process in self.processes:
            if process.exitcode is None:
                process.terminate()
        for process in self.processes:
            process.join(timeout)
            if process.exitcode is None:
                process.kill()
                process.join()


def _can_fork() -> bool:
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def _worker_once_told(read_end: int, others: list[int], environ: dict[str, str], options: list[str]) -> None:
    """A forked worker: wait for the dispatcher's address, then serve it as `paratrain worker`."""
    for fd in others:  # the other workers' pipes: an end held here would keep them from ending
        os.close(fd)
    with os.fdopen(read_end) as pipe:
        told = pipe.readline().split()
    if not told:
        return  # the dispatcher never listened (it said why)
    host, port = told
    forking.run_command(environ, ["worker", "--host", host, "--port", port, *options])


class _Spawned:
    """A Popen that answers like a multiprocessing.Process (exitcode, terminate, kill, join)."""

    def __init__(self, popen: subprocess.Popen):
        self.popen, self.pid = popen, popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def serve(settings: DispatcherSettings, *, local_workers: bool = False, threads: int | None = None,
          exit_with_pid: int | None = None) -> int:
    """Run a dispatcher until stopped (SIGTERM, or the process `exit_with_pid` exits); -> the
    exit status (1 if it had to stop because its workers could not serve)."""
    workers = None
    if local_workers:  # before the dispatcher and its threads: see LocalWorkers
        workers = LocalWorkers(settings.workers, settings.token, threads or default_threads(settings.workers))
    try:
        dispatcher = Dispatcher(settings)
    except BaseException:
        if workers is not None:
            workers.stop()
        raise
    dispatcher.on_ready = lambda: print(f"{READY_MARK} {dispatcher.address}", flush=True)
    dispatcher.say(f"listening on {dispatcher.address}, waiting for {settings.workers} worker(s)"
                   + (" (starting them here)" if local_workers else ""))
    signal.signal(signal.SIGTERM, lambda *_: dispatcher.stop())
    if workers is not None:
        workers.tell(dispatcher.address)

    def watch() -> None:
        for pid, how in workers.exited() if workers is not None else ():
            rank = next((w.rank for w in dispatcher.peers.workers.values() if w.hello.pid == pid), None)
            if rank is None:
                dispatcher.fail(f"a worker process (pid {pid}) ended before it joined: {how}")
            else:
                dispatcher.lose_worker(rank, how)

    def should_stop() -> bool:
        return exit_with_pid is not None and not process_alive(exit_with_pid)

    try:
        dispatcher.serve(should_stop, on_tick=watch)
    finally:
        if workers is not None:
            workers.stop()
    return 1 if dispatcher.failure else 0

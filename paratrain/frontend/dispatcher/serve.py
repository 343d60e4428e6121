"""`paratrain serve`: a dispatcher, with its workers or without.

Without `local_workers` the workers join from anywhere with `paratrain worker --host H --port P`
(under torchrun they keep torchrun's world). With it, each worker is a process started here
that joins the same way and forms the world through the store the dispatcher hosts. (Not
PyTorch's elastic launcher: it treats one worker's exit as the whole group's failure and stops
the rest, while a dispatcher serves on when a worker is lost.) A worker process that exits is
reported as lost, at once, with how it ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from paratrain import forking
from paratrain.frontend.dispatcher.dispatcher import Dispatcher
from paratrain.frontend.dispatcher.settings import DispatcherSettings
from paratrain.frontend.processes import describe_exit, pid_alive
from paratrain.frontend.protocol.addresses import READY_MARK
from paratrain.settings import child_environment


def default_threads(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


class LocalWorkers:
    """`paratrain worker` processes on this machine, one per worker: forked from a server that
    imported torch once (paratrain/forking.py), or spawned where the platform cannot fork."""

    def __init__(self, address: str, count: int, token: str | None, threads: int):
        host, _, port = address.rpartition(":")
        forks = forking.forkserver_context()
        self.processes = []
        for local_rank in range(count):
            env = child_environment(OMP_NUM_THREADS=str(threads), LOCAL_RANK=str(local_rank))
            if token:
                env["PARATRAIN_TOKEN"] = token
            argv = ["worker", "--host", host, "--port", port, "--threads", str(threads),
                    "--exit-with-pid", str(os.getpid())]
            if forks is None:
                self.processes.append(_Spawned(subprocess.Popen([sys.executable, "-m", "paratrain", *argv], env=env)))
            else:
                process = forks.Process(target=forking.run_command, args=(env, argv), name=f"worker{local_rank}")
                process.start()
                self.processes.append(process)
        self.reported: set[int] = set()

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
        for process in self.processes:
            if process.exitcode is None:
                process.terminate()
        for process in self.processes:
            process.join(timeout)
            if process.exitcode is None:
                process.kill()
                process.join()


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
    if local_workers:
        forking.forkserver_context()  # the server imports torch while the dispatcher sets up
    dispatcher = Dispatcher(settings)
    dispatcher.on_ready = lambda: print(f"{READY_MARK} {dispatcher.address}", flush=True)
    dispatcher.say(f"listening on {dispatcher.address}, waiting for {settings.workers} worker(s)"
                   + (" (starting them here)" if local_workers else ""))
    signal.signal(signal.SIGTERM, lambda *_: dispatcher.stop())
    workers = None
    if local_workers:
        workers = LocalWorkers(dispatcher.address, settings.workers, settings.token,
                               threads or default_threads(settings.workers))

    def watch() -> None:
        for pid, how in workers.exited() if workers is not None else ():
            rank = next((w.rank for w in dispatcher.peers.workers.values() if w.hello.pid == pid), None)
            if rank is None:
                dispatcher.fail(f"a worker process (pid {pid}) ended before it joined: {how}")
            else:
                dispatcher.lose_worker(rank, how)

    def should_stop() -> bool:
        return exit_with_pid is not None and not pid_alive(exit_with_pid)

    try:
        dispatcher.serve(should_stop, on_tick=watch)
    finally:
        if workers is not None:
            workers.stop()
    return 1 if dispatcher.failure else 0

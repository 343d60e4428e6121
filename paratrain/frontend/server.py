"""Starting a dispatcher, with its workers or without.

`serve(...)` runs a dispatcher. With `local_workers=True` it also starts the workers on this
machine through PyTorch's elastic launcher (the machinery behind `torchrun`), which forms
their world; otherwise workers join from anywhere with `paratrain worker --host H --port P`.

`LocalServer.start(n)` is the auto-start: it runs `python -m paratrain serve --local-workers`
as a child process, waits for the line that says it is ready, and stops it when asked (the
child also stops by itself when the process that started it is gone).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

from paratrain.frontend.dispatcher import Dispatcher

READY_MARK = "PARATRAIN_READY"


def default_threads(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


def serve(host: str = "127.0.0.1", port: int = 0, workers: int = 1, *, local_workers: bool = False,
          token: str | None = None, log_path: str | None = None, threads: int | None = None,
          exit_with_pid: int | None = None, client_timeout: float = 30.0,
          worker_timeout: float = 5.0, max_message_mb: int = 1024, quiet: bool = False) -> None:
    dispatcher = Dispatcher(host, port, workers, token=token, log_path=log_path,
                            client_timeout=client_timeout, worker_timeout=worker_timeout,
                            max_message_mb=max_message_mb, quiet=quiet)
    dispatcher.on_ready = lambda: print(f"{READY_MARK} {dispatcher.address}", flush=True)
    dispatcher.say(f"listening on {dispatcher.address}, waiting for {workers} worker(s)"
                   + (" (starting them here)" if local_workers else ""))

    def parent_gone() -> bool:
        return exit_with_pid is not None and not _pid_alive(exit_with_pid)

    if not local_workers:
        signal.signal(signal.SIGTERM, lambda *_: dispatcher.stop())
        dispatcher.serve(parent_gone)
        return
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher import api  # noqa: F401 - creates the launcher's loggers

    # The launcher reports a SIGTERM (how LocalServer.stop ends us) as warnings.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    loop = threading.Thread(target=dispatcher.serve, args=(parent_gone,), name="dispatcher", daemon=True)
    loop.start()
    try:
        _launch_workers(dispatcher.address, workers, token, threads or default_threads(workers))
    except SignalException:
        pass  # asked to stop: the launcher has already stopped the workers
    finally:
        dispatcher.stop()
        loop.join(timeout=10)


def _launch_workers(address: str, workers: int, token: str | None, threads: int) -> None:
    """The workers as one world of processes, through paratrain's launcher (PyTorch's elastic
    launcher underneath): each joins the world, then serves the dispatcher."""
    from paratrain.launch import run

    os.environ["OMP_NUM_THREADS"] = str(threads)
    run(_local_worker, workers, launcher="processes", args=(address, token, threads))


def _local_worker(group, address: str, token: str | None, threads: int) -> None:
    from paratrain.frontend.worker import run_worker

    run_worker(address, token, group=group, local_rank=int(os.environ.get("LOCAL_RANK", "0")), threads=threads)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_until_ready(process: subprocess.Popen, timeout: float) -> str:
    """Read a `paratrain serve` child's stdout until it says it is ready; -> its address.
    Later output passes through to ours, so that a full pipe never blocks the server."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            line = process.stdout.readline()
            if line.startswith(READY_MARK):
                threading.Thread(target=_pass_through, args=(process.stdout,), daemon=True).start()
                return line.split()[1]
            sys.stdout.write(line)
        if process.poll() is not None:
            raise RuntimeError(f"the frontend server exited with code {process.returncode} before it "
                               "was ready (its messages are above)")
    raise TimeoutError(f"the frontend server was not ready within {timeout:g}s")


def _pass_through(stream) -> None:
    for line in stream:
        sys.stdout.write(line)


class LocalServer:
    """A dispatcher and its workers in a child process of this one."""

    def __init__(self, process: subprocess.Popen, address: str):
        self.process, self.address = process, address

    @classmethod
    def start(cls, workers: int = 1, *, token: str | None = None, timeout: float = 180.0,
              extra_args: tuple = ()) -> LocalServer:
        command = [sys.executable, "-m", "paratrain", "serve", "--workers", str(workers),
                   "--local-workers", "--port", "0", "--exit-with-pid", str(os.getpid()), "--quiet", *extra_args]
        env = dict(os.environ)
        if token:
            env["PARATRAIN_TOKEN"] = token
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
        try:
            address = wait_until_ready(process, timeout)
        except BaseException:
            process.kill()
            process.wait()
            raise
        return cls(process, address)

    def stop(self, timeout: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


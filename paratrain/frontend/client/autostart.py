"""Auto-start: a dispatcher and its workers in a child process of the program.

`LocalServer.start(n)` runs `python -m paratrain serve --local-workers` as a child (forked from
a server that imported torch once: paratrain/forking.py), waits for the line that says it is
ready, and stops it when asked. The child also stops by itself when
the program that started it is gone (`--exit-with-pid`), and stops its workers either way.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time

from paratrain import forking
from paratrain.frontend.protocol.addresses import READY_MARK
from paratrain.environment import child_environment


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
        argv = ["serve", "--workers", str(workers), "--local-workers", "--port", "0",
                "--exit-with-pid", str(os.getpid()), "--quiet", *extra_args]
        env = child_environment(PARATRAIN_TOKEN=token) if token else child_environment()
        process = forking.start_command(argv, env, capture_stdout=True)
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

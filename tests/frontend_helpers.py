"""Servers for the frontend tests: each one a dispatcher with its workers in child processes,
stopped by the fixture that started it (and by itself if the test process dies)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import zmq

from paratrain.frontend import wire
from paratrain.frontend.handshake import handshake

PYTHON_M_PARATRAIN = [sys.executable, "-m", "paratrain"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop(process: subprocess.Popen, timeout: float = 20.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until(condition, timeout: float, what: str, interval: float = 0.1):
    """Poll `condition()` until it returns something true (-> that value); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout:g}s: {what}"
        time.sleep(interval)
    return value


@contextlib.contextmanager
def raw_client(address: str, token: str | None = None):
    """A client socket that speaks the wire format directly (to send what the API never would)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    try:
        welcome = handshake(sock, "client", token, {"pid": os.getpid()}, 30.0, address)
        yield sock, welcome
    finally:
        sock.send(wire.encode({"t": "bye"}))
        sock.close(linger=200)
        context.term()


def raw_sync(sock, ops: list, fetch=(), token: int = 10_000, frames=()) -> tuple[dict, list]:
    sock.send_multipart([wire.encode({"t": "run", "ops": ops, "sync": token, "fetch": list(fetch)}), *frames])
    while True:
        assert sock.poll(30_000), "no reply from the dispatcher"
        reply = sock.recv_multipart()
        header = wire.decode(reply[0])
        if header["t"] == "synced" and header["token"] == token:
            return header, reply[1:]

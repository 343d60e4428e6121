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

from paratrain.frontend.protocol import VERSION, codec, messages
from paratrain.frontend.protocol.handshake import ACCEPTS, handshake

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


def client_hello() -> messages.Hello:
    return messages.Hello("client", VERSION, os.getpid(), "raw test client", "localhost", "", None)


@contextlib.contextmanager
def raw_client(address: str, token: str | None = None):
    """A client socket that speaks the protocol directly (to send what the API never would)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    try:
        welcome = handshake(sock, client_hello(), token, 30.0, address)
        yield sock, welcome
    finally:
        sock.send_multipart(codec.encode(messages.Bye()))
        sock.close(linger=200)
        context.term()


def reply_to(sock, timeout_ms: int = 30_000):
    """The next message the dispatcher sends this client socket."""
    assert sock.poll(timeout_ms), "no reply from the dispatcher"
    return codec.decode(sock.recv_multipart(), ACCEPTS["client"])


def raw_sync(sock, instructions: list, fetch=(), token: int = 10_000, frames=()) -> messages.Synced:
    """Send instructions (Instruction, or raw wire lists to test the decoder) with a sync; -> the
    Synced reply."""
    sock.send_multipart(codec.encode(messages.Run(instructions, token, list(fetch), list(frames))))
    while True:
        reply = reply_to(sock)
        if isinstance(reply, messages.Synced) and reply.token == token:
            return reply
        assert not isinstance(reply, messages.Error), reply.message

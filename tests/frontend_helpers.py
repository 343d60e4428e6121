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

import paratrain.frontend as gt
from paratrain import forking
from paratrain.frontend.client.autostart import LocalServer
from paratrain.frontend.protocol import VERSION, codec, messages
from paratrain.frontend.protocol.auth import secure_connector
from paratrain.frontend.protocol.handshake import ACCEPTS, join

PYTHON_M_PARATRAIN = [sys.executable, "-m", "paratrain"]


def paratrain_command(*argv: str, env: dict | None = None, stdout: bool = False, stderr=None):
    """`python -m paratrain ARGV` in a child process, forked from the server that imported torch
    once (as LocalServer starts a dispatcher): a fresh interpreter would spend 3 s of CPU on
    importing torch first, which 2 cores under the whole suite feel. Popen's face."""
    return forking.start_command(list(argv), {**os.environ, **(env or {})}, capture_stdout=stdout, stderr=stderr)


def run_paratrain(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m paratrain ARGV` to its end, as subprocess.run(capture_output=True, text=True)."""
    process = paratrain_command(*argv, env=env, stdout=True, stderr=subprocess.PIPE)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        stop(process)
    return subprocess.CompletedProcess(["paratrain", *argv], process.returncode, out, err)


def forked_program(target, *args):
    """target(*args) in a child process forked from paratrain's fork server, which has imported
    torch (`python -c` would spend seconds of CPU importing it first), under this process's
    environment as it is now: a client program for the tests that pause or kill one. -> the
    started multiprocessing Process (pid, kill(), join(), exitcode)."""
    import multiprocessing

    context = forking.forkserver_context() or multiprocessing.get_context("spawn")
    process = context.Process(target=_in_environment, args=(dict(os.environ), target, *args), daemon=True)
    process.start()
    return process


def _in_environment(environ: dict, target, *args) -> None:
    forking.adopt_environment(environ)
    target(*args)


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
    try:
        sock, welcome = join(context, f"tcp://{address}", client_hello(), token, 30.0, address)
    except BaseException:
        context.term()
        raise
    try:
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


TOKEN = "fuzz-token"  # token_server's (conftest.py): "before authentication" then includes the challenge


def well_behaved_check(address: str, round_number: int, token: str | None = TOKEN) -> None:
    """A client that plays by the rules gets correct values (on both workers)."""
    session = gt.Session(address, token=token, timeout=30)
    try:
        a = session.call("full", [4], {"dtype": None, "value": float(round_number)})[0]
        b = session.call("ones", [4], {"dtype": None}, worker=1)[0]
        total = ((a + b) * 2.0).sum()
        (value,) = session.sync([total._handle])
        assert float(value) == 8.0 * (round_number + 1)
    finally:
        session.close()


def stranger(address: str, token: str | None = None):
    """A peer that has not joined (with the token: past ZeroMQ's handshake, before the challenge);
    -> (its context, its socket)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_connector(sock, token)
    sock.connect(f"tcp://{address}")
    return context, sock


def serve_saying(said, *args: str):
    """`paratrain serve --local-workers ARGS`, its stderr (what it says) in the file `said`;
    -> its LocalServer, with `.said`."""
    with open(said, "w") as stderr:
        process, address = start_serve("--local-workers", *args, stderr=stderr)
    server = LocalServer(process, address)
    server.said = said
    return server


def start_serve(*args: str, stderr=None, timeout: float = 120, fresh: bool = False) -> tuple[subprocess.Popen, str]:
    """`paratrain serve ARGS` in a child process (its stderr to `stderr`, a file); -> (the
    process, its address once ready). Stop it with `stop`. `fresh`: a new interpreter, for an
    environment that torch reads as it is imported (the server's torch was imported before)."""
    from paratrain.frontend.client.autostart import wait_until_ready

    if fresh:
        process = subprocess.Popen([*PYTHON_M_PARATRAIN, "serve", "--port", "0", *args], stdout=subprocess.PIPE,
                                   stderr=stderr, text=True)
    else:
        process = paratrain_command("serve", "--port", "0", *args, stdout=True, stderr=stderr)
    try:
        return process, wait_until_ready(process, timeout)
    except BaseException:
        stop(process)
        raise


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def listening_addresses(pid: int) -> list[str]:
    """The local addresses (IP:port) of the TCP sockets process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    found.append(_address(local))
    return found


def _address(hex_address: str) -> str:
    import ipaddress

    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:  # /proc writes IPv6 as four little-endian 32-bit words
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return f"{ip}:{int(port, 16)}"


@contextlib.contextmanager
def standalone_workers(count: int, *serve_args: str):
    """`paratrain serve` and `count` `paratrain worker` processes started by hand, as a user
    would on several machines; -> (the serve process, its address)."""
    from paratrain.frontend.client.autostart import wait_until_ready

    port = free_port()
    serve = paratrain_command("serve", "--workers", str(count), "--port", str(port), *serve_args, stdout=True)
    workers = [paratrain_command("worker", "--port", str(port), "--threads", "1") for _ in range(count)]
    try:
        yield serve, wait_until_ready(serve, 120)
    finally:
        for process in (serve, *workers):
            stop(process)

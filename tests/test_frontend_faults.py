"""Faults a frontend user meets, and what each costs: a worker killed while a client waits on it
(standalone, and under --local-workers), a client dropped while it was paused, the workers'
store, bad ports and unreachable dispatchers, and what a program queued when it exits.
(What an auto-started program leaves behind: test_frontend_workers.py.)"""

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner

import paratrain.frontend as gt
from frontend_helpers import (
    forked_program, free_port, listening_addresses, run_paratrain, standalone_workers, start_serve, stop, wait_until,
)
from paratrain.cli import main as paratrain_cli
from paratrain.frontend.client.autostart import LocalServer
from paratrain.frontend.top import Monitor

ERROR_WITHIN_S = 10  # what the frontend promises: a client waiting on a killed worker hears of it


def _stats(address: str):
    """What `paratrain top` shows of the dispatcher at `address` now."""
    monitor = Monitor(address)
    try:
        return monitor.stats()
    finally:
        monitor.close()


def _worker(address: str, rank: int):
    """Worker `rank`'s row in the dispatcher's stats (its pid, its queue as of its last heartbeat...)."""
    return next(w for w in _stats(address).workers if w.rank == rank)


def _kill_a_worker_while_a_client_waits(address: str) -> tuple[str, float]:
    """Two clients homed on workers 0 and 1. The first starts long work on its worker and waits
    for a value; its worker is killed. -> (the error the waiting client got, seconds after the
    kill); the second client's work comes back right, and the dispatcher serves on."""
    first, second = gt.Session(address), gt.Session(address)
    doomed, survivor = (first, second) if first.home == 1 else (second, first)
    try:
        x = doomed.call("randn", [1000, 1000], {"dtype": None})[0]
        for _ in range(80):  # seconds of matmuls, in few instructions: the client still waits when the kill comes
            x = (x @ x).tanh()
        outcome = {}

        def wait_for_value():
            try:
                x.sum().item()
            except gt.FrontendError as error:
                outcome["error"], outcome["at"] = str(error), time.monotonic()

        waiter = threading.Thread(target=wait_for_value)
        waiter.start()

        def holding_the_work():
            row = _worker(address, doomed.home)
            return row if row.queue > 0 else None
        os.kill(wait_until(holding_the_work, 30, "the worker holds the work the client waits on").pid, signal.SIGKILL)
        killed = time.monotonic()
        waiter.join(60)
        assert "error" in outcome, "the waiting client got no error"
        kept = survivor.call("full", [3], {"dtype": None, "value": 2.0})[0]
        assert (kept * 3.0).numpy().tolist() == [6.0, 6.0, 6.0]
        return outcome["error"], outcome["at"] - killed
    finally:
        for session in (first, second):
            try:
                session.close()
            except gt.FrontendError:
                pass


def test_a_standalone_worker_killed_while_a_client_waits_fails_that_client_only():
    with standalone_workers(2, "--worker-timeout", "2") as (serve, address):
        error, seconds = _kill_a_worker_while_a_client_waits(address)
        print(f"\nstandalone worker killed: the waiting client's error came {seconds:.2f}s later: {error}")
        assert "worker 1 is lost" in error and seconds < ERROR_WITHIN_S, (error, seconds)
        assert serve.poll() is None


def test_a_local_worker_killed_is_reported_at_once_and_the_server_serves_on(tmp_path):
    log = tmp_path / "serve.err"
    with open(log, "w") as stderr:
        serve, address = start_serve("--workers", "2", "--local-workers", "--threads", "1", stderr=stderr)
    try:
        error, seconds = _kill_a_worker_while_a_client_waits(address)
        print(f"\nlocal worker killed: the waiting client's error came {seconds:.2f}s later: {error}")
        assert "worker 1 is lost (its process was killed by SIGKILL)" in error and seconds < ERROR_WITHIN_S, \
            (error, seconds)
        assert serve.poll() is None
        text = log.read_text()
        assert "worker 1 is lost: its process was killed by SIGKILL" in text and "Traceback" not in text, text
    finally:
        stop(serve)


def test_the_workers_store_listens_where_serve_does(server):
    """conftest's server binds loopback; its local workers met at a store it hosts."""
    addresses = listening_addresses(server.process.pid)
    assert len(addresses) >= 2, addresses  # the dispatcher and the store
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses


@pytest.fixture(scope="module")
def quick_drop_server():
    """A dispatcher that drops a client after 2 s without a heartbeat (two of its heartbeats), so
    that a paused client is dropped soon; only the paused client's test uses it, so no healthy
    client of a loaded host risks being dropped."""
    srv = LocalServer.start(1, extra_args=("--client-timeout", "2"))
    yield srv
    srv.stop()


def _client_to_pause(address: str, channel) -> None:
    """A client program: makes a tensor, says so, waits for `channel` to say go, then reads it."""
    session = gt.Session(address, timeout=120)
    x = session.call("ones", [4], {"dtype": None})[0]
    channel.send(f"ready {x.sum().item()}")
    channel.recv()
    try:
        x.sum().item()
        channel.send("read it")
    except gt.ConnectionLost as error:
        channel.send(f"lost: {error}")


def test_a_client_dropped_while_paused_is_told_so_at_its_next_call(quick_drop_server):
    ours, theirs = multiprocessing.Pipe()
    child = forked_program(_client_to_pause, quick_drop_server.address, theirs)
    try:
        assert ours.poll(60) and ours.recv() == "ready 4.0"
        os.kill(child.pid, signal.SIGSTOP)  # paused: no heartbeats
        wait_until(lambda: child.pid not in [c.pid for c in _stats(quick_drop_server.address).clients], 30,
                   "the dispatcher drops the paused client")
        os.kill(child.pid, signal.SIGCONT)
        ours.send("go")
        assert ours.poll(60), "no answer"  # not the 120 s of waiting for an answer
        said = ours.recv()
        assert said.startswith("lost:") and "dropped: no heartbeat" in said, said
    finally:
        child.kill()
        child.join(10)


# ---- errors at the command line -------------------------------------------------------------------

def test_serve_refuses_a_port_out_of_range():
    result = CliRunner().invoke(paratrain_cli, ["serve", "--port", "99999"])
    assert result.exit_code == 2 and "99999 is not in the range 0<=x<=65535" in result.output


def test_serve_refuses_a_join_timeout_that_is_not_positive():
    result = CliRunner().invoke(paratrain_cli, ["serve", "--join-timeout", "0"])
    assert result.exit_code == 2 and "'--join-timeout'" in result.output and "x>0" in result.output, result.output


def test_serve_on_a_port_in_use_says_so_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_paratrain("serve", "--port", str(port))
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 1 and line.startswith("paratrain serve: error: "), done.stderr
    assert f"port {port} on 127.0.0.1 is in use" in line and "--port 0" in line, line  # and what to do


def test_a_worker_without_a_dispatcher_waits_a_bounded_time_saying_so():
    done = run_paratrain("worker", "--port", str(free_port()), "--connect-timeout", "2")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "waiting for the dispatcher at 127.0.0.1:" in lines[0], done.stderr
    assert lines[-1].startswith("paratrain worker: error: no reply from 127.0.0.1:") and "within 2s" in lines[-1], done.stderr


def test_a_worker_given_an_unknown_host_says_so_at_once():
    done = run_paratrain("worker", "--host", "no-such-host.invalid")
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 1 and line.startswith("paratrain worker: error: "), done.stderr
    assert "cannot resolve host 'no-such-host.invalid'" in line, line


# ---- a program's end -----------------------------------------------------------------------------------

def test_an_integer_tensor_cannot_require_grad_and_says_so_at_once(client):
    with pytest.raises(RuntimeError, match="only floating-point tensors can require gradients"):
        gt.tensor([1, 2], dtype="int64", requires_grad=True)
    with pytest.raises(RuntimeError, match="only floating-point tensors can require gradients"):
        gt.zeros(3, dtype="int64", requires_grad=True)


def test_what_a_program_queued_after_its_last_sync_runs_and_its_errors_fail_the_program(four_workers):
    """(A program whose queued work succeeds exits 0: the auto-started program of
    test_frontend_workers.py ends with such work.)"""
    env = {k: v for k, v in os.environ.items() if k != "PARATRAIN_SERVER"}
    failing = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import paratrain.frontend as gt
        gt.connect({four_workers.address!r})
        x = gt.randn(4, 13, requires_grad=True)
        print(x.sum().item() is not None)
        loss = gt.cross_entropy(x, gt.tensor([1, 2, 30, 4], dtype="int64"))   # fails on the worker, after the last sync
        loss.backward()
    """)], capture_output=True, text=True, timeout=180, env=env)
    assert failing.returncode == 1, (failing.stdout, failing.stderr)
    assert "paratrain frontend: at exit: cross_entropy(float32[4, 13], int64[4]) failed on worker" in failing.stderr
    assert "out of bounds" in failing.stderr

    def logged_cross_entropy():  # lines are written when the workers report their timings
        return [line for line in four_workers.log.read_text().splitlines()
                if "float32[4,13]" in line and "| OP " in line and " op=cross_entropy " in line]
    wait_until(logged_cross_entropy, 10, "the failed cross_entropy in the instruction log")


def test_a_worker_lost_before_every_worker_served_stops_the_server_with_one_line(tmp_path):
    """A local worker that cannot start: the world cannot form, so the server says why and stops."""
    # Each worker asks for a GPU and sees none (hidden on a GPU machine too): it fails at once
    done = run_paratrain("serve", "--port", "0", "--workers", "2", "--local-workers",
                         env={"PARATRAIN_BACKEND": "cuda", "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "cannot go on: a worker process (pid" in done.stderr and "ended before it joined" in done.stderr


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stops answering"])
def test_a_client_of_a_lost_dispatcher_learns_of_it_within_ten_seconds(how):
    """Killed: its connection closes. Stopped (as a host that vanished): nothing closes, and only
    the heartbeat connection's PING going unanswered tells."""
    serve, address = start_serve("--workers", "1", "--local-workers")
    try:
        session = gt.Session(address, timeout=120)  # the old way out: no answer within the timeout
        try:
            assert session.upload(np.ones(3, dtype=np.float32)).numpy().sum() == 3.0
            if how == signal.SIGSTOP:  # one case checks it: both keep the same heartbeat connection
                time.sleep(3)  # the condition under test: quiet past RECONNECT_S, the client keeps its dispatcher
            assert session.connection.lost is None
            serve.send_signal(how)
            lost_at = time.monotonic()
            with pytest.raises(gt.ConnectionLost, match="its connection dropped and did not come back"):
                session.upload(np.ones(3, dtype=np.float32)).numpy()
            assert time.monotonic() - lost_at < ERROR_WITHIN_S
        finally:
            session.connection.close(say_bye=False)
    finally:
        serve.send_signal(signal.SIGKILL)
        serve.wait()

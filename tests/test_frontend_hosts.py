"""The frontend across hosts, played on one machine as docs/cluster.md shows it: a dispatcher
listening beyond loopback (0.0.0.0) with a token, a worker on each of two simulated hosts
(PARATRAIN_HOST=node0, node1: they share no memory, so what moves between them goes through
gloo as between machines) joining with it, a program whose tensors live on both, and a worker
with a wrong token refused in one line while the dispatcher serves on."""

from __future__ import annotations

import numpy as np
import pytest

import paratrain.frontend as gt
from frontend_helpers import free_port, paratrain_command, run_paratrain, stop, wait_until
from paratrain.frontend.client.autostart import wait_until_ready
from paratrain.frontend.monitor import Monitor

TOKEN = "two-hosts-0123456789"  # beyond loopback a token needs 16 characters or more
RTOL, ATOL = 1e-5, 1e-5  # float32 products, summed in another order than NumPy's


@pytest.fixture
def two_hosts(tmp_path):
    """`paratrain serve --host 0.0.0.0 --token ...` and one worker per simulated host, stopped at
    the end whatever happened; -> (the address clients use, the dispatcher's stderr file)."""
    port = free_port()
    said = tmp_path / "serve.err"
    with open(said, "w") as stderr:
        serve = paratrain_command("serve", "--host", "0.0.0.0", "--port", str(port), "--workers", "2",
                                  "--token", TOKEN, stdout=True, stderr=stderr)
    started = [serve]
    try:
        started.append(_worker(port, TOKEN, "node0"))
        wait_until(lambda: "joined (node0, pid" in said.read_text(), 60, "the worker on node0 joins as worker 0")
        stranger = run_paratrain("worker", "--host", "127.0.0.1", "--port", str(port), "--token", "not-the-token-at-all",
                                 "--connect-timeout", "30", env={"PARATRAIN_HOST": "node9"})
        assert stranger.returncode != 0
        assert stranger.stderr.strip().count("\n") == 0 and "wrong token" in stranger.stderr, stranger.stderr
        started.append(_worker(port, TOKEN, "node1"))
        wait_until_ready(serve, 120)  # said once every worker serves
        yield f"127.0.0.1:{port}", said
    finally:
        for process in started:
            stop(process)
    assert all(process.poll() is not None for process in started)


def _worker(port: int, token: str, host: str):
    return paratrain_command("worker", "--host", "127.0.0.1", "--port", str(port), "--token", token,
                             "--threads", "1", env={"PARATRAIN_HOST": host})


def test_workers_on_two_hosts_compute_together_behind_a_token_and_a_wrong_token_is_refused(two_hosts):
    address, said = two_hosts
    wait_until(lambda: "refused 1 connection(s) in the encrypted handshake" in said.read_text(), 30,
               "the dispatcher says it refused the worker with the wrong token")
    rng = np.random.default_rng(0)
    x_np, w_np = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)
    gt.connect(address, token=TOKEN)
    try:
        with gt.worker(0):
            x = gt.from_numpy(x_np)
        with gt.worker(1):
            w = gt.from_numpy(w_np, requires_grad=True)
        loss = (x @ w).sum()  # runs on worker 0 (node0): w crosses from node1
        loss.backward()  # its gradient crosses back to node1
        np.testing.assert_allclose(loss.item(), (x_np @ w_np).sum(), rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(w.grad.numpy(), x_np.T @ np.ones((8, 4), np.float32), rtol=RTOL, atol=ATOL)
    finally:
        gt.disconnect()
    monitor = Monitor(address, token=TOKEN)
    try:
        workers = monitor.stats().workers
    finally:
        monitor.close()
    assert {(w.rank, w.host) for w in workers} == {(0, "node0"), (1, "node1")}
    assert all(w.alive for w in workers)
    assert "joined (node1, pid" in said.read_text()  # the dispatcher's join line names the host
